"""The house rules of the package's layout, checked: every module says what it holds, no function is long, the
registries need no MXNet, the commands take their choices from the registries, no module imports another's private
name or probes what kind of object it has (``hasattr``), and no public function takes more than
``MAX_PARAMETERS`` parameters. The first and the last rules hold for the benchmark scripts too, which share what
they have in common through ``benchmarks/harness.py``."""
import ast
import os
import re
import sys
import textwrap

import pytest

from conftest import ROOT, run_process

PACKAGE = os.path.join(ROOT, "parallel")
MODULES = sorted(os.path.relpath(os.path.join(d, n), ROOT) for d, _, names in os.walk(PACKAGE)
                 for n in names if n.endswith(".py"))
#: The benchmark scripts and the harness they share (``benchmarks/*.py``).
BENCHMARKS = sorted(os.path.join("benchmarks", n) for n in os.listdir(os.path.join(ROOT, "benchmarks"))
                    if n.endswith(".py"))
#: The tests and the fixtures they share (``tests/*.py``).
TESTS = sorted(os.path.join("tests", n) for n in os.listdir(os.path.join(ROOT, "tests")) if n.endswith(".py"))
NOTEBOOKS = sorted(os.path.join("notebooks", n) for n in os.listdir(os.path.join(ROOT, "notebooks"))
                   if n.endswith(".ipynb"))


def _notebook_code(path):
    """A notebook's code cells as one module's source, IPython's ``%`` and ``!`` lines left out."""
    import json
    with open(os.path.join(ROOT, path)) as f:
        cells = json.load(f)["cells"]
    lines = []
    for cell in cells:
        if cell["cell_type"] == "code":
            lines += [line for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!"))]
            lines.append("")
    return "\n".join(lines)

#: The most lines of code (not counting docstrings, comments and blank lines) a function may have.
MAX_FUNCTION_LINES = 60

#: The most parameters (not counting ``self`` and ``cls``) a public function or method may take.
MAX_PARAMETERS = 10


def _code_lines(source, node):
    skip = set()
    if ast.get_docstring(node) is not None:
        skip = set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    lines = source.splitlines()[node.lineno - 1:node.end_lineno]
    return sum(1 for i, text in enumerate(lines, start=node.lineno)
               if text.strip() and not text.strip().startswith("#") and i not in skip)


@pytest.mark.parametrize("module", MODULES + BENCHMARKS)
def test_every_module_says_what_it_holds_and_has_no_long_function(module):
    source = open(os.path.join(ROOT, module)).read()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 8, f"{module}: its opening docstring must say what the module holds"
    long = [(node.name, n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in [_code_lines(source, node)] if n > MAX_FUNCTION_LINES]
    assert not long, f"{module}: functions over {MAX_FUNCTION_LINES} lines of code: {long}"


def test_the_registries_and_the_commands_load_without_mxnet():
    """What the commands need before MXNet starts: the registries of names, the checks, the parsers."""
    code = ("import sys\n"
            "import parallel, parallel.comm, parallel.models, parallel.data, parallel.strategies\n"
            "import parallel.validate, parallel.cli, parallel.files, parallel.interrupt, parallel.threads\n"
            "import parallel.train, parallel.launch\n"
            "parallel.train.build_parser(); parallel.launch.build_parser()\n"
            "assert 'mxnet' not in sys.modules, 'mxnet was imported'\n")
    result = run_process([sys.executable, "-c", code], timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_the_cli_offers_exactly_the_registries():
    from parallel.comm import ALGORITHMS
    from parallel.data import DATASETS
    from parallel.models import MODELS
    from parallel.strategies import STRATEGIES
    from parallel.train import build_parser
    choices = {action.dest: action.choices for action in build_parser().options}
    assert choices["allreduce"] == list(ALGORITHMS)
    assert choices["model"] == list(MODELS)
    assert choices["strategy"] == list(STRATEGIES)
    assert choices["dataset"] == list(DATASETS)


@pytest.mark.slow   # seconds the fast tier's 150 s budget cannot spare (docs/testing.md)
def test_a_submodule_never_hides_the_function_of_the_same_name():
    """``parallel.models.lenet`` is the network function whether or not its module was imported first."""
    code = ("import parallel.models.lenet\n"
            "import parallel.models\n"
            "from parallel.models import lenet\n"
            "assert callable(lenet) and lenet.__name__ == 'lenet', lenet\n"
            "assert parallel.models.lenet is lenet\n")
    result = run_process([sys.executable, "-c", code], timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


# ---- the import direction (docs/architecture.md) ---------------------------------------------------------------

#: The package's modules in layers: a module imports only from lower layers. A sub-package is one node, but its
#: ``__init__`` (``name:names``, the registry of names the CLI reads before MXNet starts) and its ``registry``
#: module (``name.registry``, where names become objects) are nodes of their own.
LAYERS = [
    ["mxnet_compat"],
    ["lazy", "validate", "files", "engine", "flight", "handover"],
    ["cli"],
    ["trace", "mesh"],
    ["split"],
    ["parallel", "comm:names", "compress:names", "data:names", "models:names", "optim:names", "strategies:names",
     "launch:names", "devices", "threads", "interrupt", "report", "board", "job"],
    ["compress", "data", "layout", "launch"],
    ["config"],
    ["compress.registry"],
    ["comm"],
    ["shard"],
    ["models", "trainer_kvstore"],
    ["optim", "export"],
    ["models.registry", "checkpoint", "step", "evaluate"],
    ["strategies", "uneven"],
    ["strategies.registry"],
    ["fit"],
    ["train_steps"],
    ["train"],
]
_PACKAGES = {"comm", "compress", "data", "models", "optim", "strategies", "launch"}


def _node(module):
    parts = module.split(".")
    if len(parts) == 1:
        return "parallel"
    if parts[1] in _PACKAGES:
        if len(parts) == 2:
            return parts[1] + ":names"
        return parts[1] + ".registry" if parts[2] == "registry" else parts[1]
    return parts[1]


def _imports():
    """Every import of one of the package's modules by another (anywhere in the module, lazy ones too)."""
    edges = set()
    for path in MODULES:
        name = path[:-3].replace(os.sep, ".")
        name = name[:-len(".__init__")] if name.endswith(".__init__") else name
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                targets = [".".join(base + [node.module])] if node.module else \
                    [".".join(base + [alias.name]) for alias in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                targets = [n for n in names if n and (n == "parallel" or n.startswith("parallel."))]
            else:
                continue
            edges |= {(name, target) for target in targets}
    return edges


def test_imports_flow_one_way():
    """Each module imports only from the layers below its own (docs/architecture.md draws the same graph); nothing
    imports the entry points."""
    layer = {node: i for i, nodes in enumerate(LAYERS) for node in nodes}
    edges = _imports()
    unknown = sorted({_node(m) for edge in edges for m in edge} - set(layer))
    assert not unknown, f"modules in no layer of LAYERS: {unknown}"
    upward = sorted(f"{a} ({_node(a)}) imports {b} ({_node(b)})" for a, b in edges
                    if _node(a) != _node(b) and layer[_node(b)] >= layer[_node(a)])
    assert not upward, "imports against the direction:\n" + "\n".join(upward)
    assert ("parallel.comm.reducer", "parallel.job") in edges   # the graph is really read


def _private(name):
    return name.startswith("_") and not name.endswith("__")


def _private_imports(source):
    """``(line, module, name)`` of each private name (``_x``, not a dunder) a module's ``from ... import`` takes."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, "." * node.level + (node.module or ""), alias.name


def test_no_module_imports_another_modules_private_name():
    """What a module keeps private stays its own: a name another module needs is public (and documented); the
    rule's reader finds what it must."""
    assert list(_private_imports("from .idx import _KINDS, Dataset\nfrom __future__ import annotations\n"
                                 "from x import __version__\n")) == [(1, ".idx", "_KINDS")]
    found = [f"{module}:{line}: from {source} import {name}" for module in MODULES + BENCHMARKS + TESTS
             for line, source, name in _private_imports(open(os.path.join(ROOT, module)).read())]
    assert not found, "private names imported:\n" + "\n".join(found)


#: Private names any code may read, each for its reason: ``None`` for any object's, else the one module's. The
#: namedtuple API names its methods and its fields' tuple with an underscore so that they cannot clash with a
#: field; ``os._exit`` ends a process at once, without the interpreter's shutdown (which could block in ps-lite);
#: ``sys._current_frames`` is the one way to read every thread's stack (the flight recorder's dump).
ALLOWED_PRIVATE = {"_replace": None, "_asdict": None, "_fields": None, "_make": None, "_exit": "os",
                   "_current_frames": "sys"}

#: The one module that reads MXNet's private API, and what it reads there (``parallel.mxnet_compat`` says why).
COMPAT = os.path.join("parallel", "mxnet_compat.py")
COMPAT_READS = {"_collect_params_with_prefix", "_LIB", "_internal", "_sparse_label", "_params", "_kvstore",
                "_update_on_kvstore", "_distributed", "_fresh_grad", "_sync_copyfrom", "_slice"}

#: The calls that name an attribute by a string: ``setattr(obj, "_x", v)``, ``monkeypatch.setattr(obj, "_x", v)``,
#: ``monkeypatch.setattr("module._x", v)``, ``getattr(obj, "_x")``, ...
_BY_NAME = {"setattr", "getattr", "hasattr", "delattr"}


def _allowed(owner, name, module):
    if name in ALLOWED_PRIVATE:
        return ALLOWED_PRIVATE[name] in (None, owner)
    return module == COMPAT and name in COMPAT_READS


def _embedded(node):
    """The tree of a string constant that is Python code (a script a test runs in a fresh process), or None."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value):
        return None
    try:
        return ast.parse(textwrap.dedent(node.value))
    except SyntaxError:
        return None


def _called(node):
    """The name of the function a call calls (``setattr`` for ``monkeypatch.setattr(...)``), or None."""
    if isinstance(node, ast.Call):
        return getattr(node.func, "id", None) or getattr(node.func, "attr", None)
    return None


def _private_uses(tree, module="", first_line=1, strings=True):
    """``(line, text)`` of each use of another object's private name (``_x``, not a dunder) in the ``ast`` tree
    of ``module``: an attribute (``obj._x``, where ``obj`` is not ``self`` or ``cls``), a ``from m import _x``, an
    attribute named by a string (``setattr(obj, "_x", v)``, ``monkeypatch.setattr("m._x", v)``), and with
    ``strings`` the same in the code a string holds (a script a test runs in a fresh process). What
    ``ALLOWED_PRIVATE`` allows passes, and ``COMPAT_READS`` in ``COMPAT`` alone. Docstrings are prose, not a script
    (a doctest's prompts are no Python): they are not parsed."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        line = first_line + getattr(node, "lineno", 1) - 1
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls") and not _allowed(owner, node.attr, module):
                yield line, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            yield from ((line, f"from {node.module} import {a.name}") for a in node.names
                        if _private(a.name) and not _allowed(node.module, a.name, module))
        elif _called(node) in _BY_NAME:
            named = [arg.value.rsplit(".", 1)[-1] for arg in node.args[:2]
                     if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            if any(_private(name) and not _allowed(None, name, module) for name in named):
                yield line, ast.unparse(node)[:100]
        code = _embedded(node) if strings and id(node) not in docstrings else None
        if code is not None:
            yield from _private_uses(code, module, line)


def test_no_code_uses_another_objects_private_name():
    """No module, benchmark, test or notebook reaches into another module's or object's private names (MXNet's are
    read in ``parallel.mxnet_compat`` alone): what another needs is public and documented, a test goes through the
    public API. The rule's reader finds each kind of use."""
    snippet = ast.parse(
        "import os\nfrom m import _hidden, shown\nx = obj._cache + self._own + cls._own + p._replace(a=1)\n"
        "monkeypatch.setattr(engine, '_LOCK', None)\nmonkeypatch.setattr('parallel.fit._run', f)\n"
        "os._exit(1)\ny = trainer._kvstore + getattr(loss, '__name__')\nCODE = '''\nimport sys\n\n"
        "sys._getframe()\n'''\nsys._exit(0)\n")
    assert sorted(line for line, _ in _private_uses(snippet)) == [2, 3, 4, 5, 7, 11, 13]
    assert sorted(line for line, _ in _private_uses(snippet, COMPAT)) == [2, 3, 4, 5, 11, 13]   # _kvstore is read there
    assert sorted(line for line, _ in _private_uses(snippet, strings=False)) == [2, 3, 4, 5, 7, 13]
    found = []
    for module in MODULES + BENCHMARKS + TESTS:
        tree = ast.parse(open(os.path.join(ROOT, module)).read())
        # this file's strings are the snippets that show the rule's reader what to find
        found += [f"{module}:{line}: {text}" for line, text in
                  _private_uses(tree, module, strings=module != os.path.join("tests", "test_layout.py"))]
    for notebook in NOTEBOOKS:   # a lesson uses what a reader may use
        found += [f"{notebook}: {text}" for _, text in _private_uses(ast.parse(_notebook_code(notebook)), notebook)]
    assert not found, "private names of other objects used:\n" + "\n".join(found)


def _public_functions(tree):
    """``(name, node)`` of every public function of a module's tree: its own, and the methods (and ``__init__``) of
    its public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and (not item.name.startswith("_") or item.name == "__init__")):
                    yield f"{node.name}.{item.name}", item


def _parameters(node):
    a = node.args
    names = [arg.arg for arg in a.posonlyargs + a.args + a.kwonlyargs] + [
        arg.arg for arg in (a.vararg, a.kwarg) if arg is not None]
    return [name for name in names if name not in ("self", "cls")]


def test_no_public_function_takes_more_than_ten_parameters():
    too_many = []
    for module in MODULES + BENCHMARKS:
        with open(os.path.join(ROOT, module)) as f:
            tree = ast.parse(f.read())
        too_many += [f"{module}: {name} takes {len(_parameters(node))}"
                     for name, node in _public_functions(tree) if len(_parameters(node)) > MAX_PARAMETERS]
    assert not too_many, "group the options into one object (as RunConfig does): " + "; ".join(too_many)


def test_the_parameter_count_sees_every_kind_of_parameter():
    tree = ast.parse("def f(a, /, b, *c, d, **e): pass\nclass K:\n    def __init__(self, x): pass\n"
                     "    def _hidden(self, y): pass\n")
    found = {name: _parameters(node) for name, node in _public_functions(tree)}
    assert found == {"f": ["a", "b", "d", "c", "e"], "K.__init__": ["x"]}


# ---- kinds are declared, not probed (docs/architecture.md, "One step, composed") ---------------------------------

#: The attribute probes (``hasattr(x, ...)``, ``getattr(x, "name", default)``) a module may make, by module and
#: attribute, each for a reason that is not learning what kind of model, replica, net or argument ``x`` is: that
#: is declared (``parallel.models.base``, ``parallel.comm.replica.Replica``, ``parallel.job.FlatParams``, ...) and
#: checked with ``isinstance``. An entry no module needs any more must go.
PROBES_ALLOWED = {
    # the platform's features: the standard library's and the OpenMP library's
    ("parallel/threads.py", "sched_getaffinity"): "os.sched_getaffinity exists on Linux only",
    ("parallel/trace.py", "sched_getaffinity"): "os.sched_getaffinity exists on Linux only",
    ("parallel/launch/processes.py", "sched_getaffinity"): "os.sched_getaffinity exists on Linux only",
    ("parallel/files.py", "O_CLOEXEC"): "an os flag of POSIX systems",
    ("parallel/files.py", "O_BINARY"): "an os flag of Windows",
    ("parallel/threads.py", "omp_get_max_threads"): "MXNet's build may not link OpenMP",
    # a name to show: a function's, else the object itself
    ("parallel/strategies/data.py", "__name__"): "an error message names the module",
    ("parallel/models/lenet.py", "__name__"): "CachedNet's repr",
    ("parallel/comm/reducer.py", "__name__"): "the Reducer's repr and description name its hook",
    # the lazy exports: a name of a module, found by its name
    ("parallel/lazy.py", "name"): "a submodule shadowed by the function of its name",
    # what the standard library leaves open
    ("parallel/data/fashion_mnist.py", "reason"): "urllib's URLError has a reason, its other errors may not",
    ("parallel/layout.py", "__iter__"): "an iterable, as collections.abc.Iterable checks it",
    # NDArray or numpy array, in a module that imports no MXNet (compress uses nothing but its codec interface)
    ("parallel/compress/feedback.py", "asnumpy"): "a checkpoint's residual is an NDArray or a numpy array",
    # the benchmarks' and the tests' own: the platform's features, a peer's version, the fields of ast's nodes
    ("benchmarks/allreduce.py", "sched_getaffinity"): "os.sched_getaffinity exists on Linux only",
    ("benchmarks/distributed.py", "sched_getaffinity"): "os.sched_getaffinity exists on Linux only",
    ("tests/test_devices.py", "sched_getaffinity"): "os.sched_getaffinity exists on Linux only",
    ("benchmarks/cluster.py", "geteuid"): "os.geteuid exists on POSIX systems only",
    ("benchmarks/horovod_worker.py", "__version__"): "a Horovod build may not say its version",
    ("tests/test_docs.py", "name"): "a module's node has no name, a class's or a function's has",
    ("tests/test_layout.py", "id"): "a call's function is a Name (id) or an Attribute (attr)",
    ("tests/test_layout.py", "attr"): "a call's function is a Name (id) or an Attribute (attr)",
    ("tests/test_layout.py", "lineno"): "ast's Module node has no line number",
}


def _probes(source):
    """``(line, attribute)`` of each ``hasattr(x, a)`` and ``getattr(x, "a", default)`` in ``source``: the attribute
    a string's value, or the expression that names it."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        name = node.args[1]
        literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
        if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3 and literal):
            yield node.lineno, name.value if literal else ast.unparse(name)


def test_no_module_probes_what_kind_of_object_it_has():
    """A model, a replica, a net or an argument says what it is by its declared type, not by the attributes it
    happens to have, in the package, its benchmarks and its tests; the few probes left are the allowlist's, each
    with its reason."""
    assert list(_probes("hasattr(net, 'ranked')\nx = getattr(r, 'aux', ())\ngetattr(mx.nd, op, None)\n"
                        "getattr(self, k)\nhasattr(v, name)\n")) == [(1, "ranked"), (2, "aux"), (5, "name")]
    found = {(module.replace(os.sep, "/"), attribute): line for module in MODULES + BENCHMARKS + TESTS
             for line, attribute in _probes(open(os.path.join(ROOT, module)).read())}
    probes = sorted(f"{module}:{line}: {attribute}" for (module, attribute), line in found.items()
                    if (module, attribute) not in PROBES_ALLOWED)
    assert not probes, "declare the kind (a base class, isinstance) instead of probing:\n" + "\n".join(probes)
    stale = sorted(f"{module}: {attribute}" for module, attribute in PROBES_ALLOWED if (module, attribute) not in found)
    assert not stale, "PROBES_ALLOWED entries no module needs any more (remove them): " + ", ".join(stale)


#: The model files whose blocks run on the proxies (``RanksF``, ``ReplicasF``): mathematics only. The mixture of
#: experts too: its dispatch over the replicas is the proxy's (the seam ``mixture``), its routing the file's.
MATHEMATICS_ONLY = ["parallel/models/vit.py", "parallel/models/transformer.py", "parallel/models/moe.py"]

#: The names holding a word of ``AXIS_WORDS`` a model file may still use, by file, each for a reason that is not an
#: axis of a layout: a mixture of experts moves tokens between its arrays' devices (MXNet's ``context``) and
#: checks the spread of its own experts (``expert_parallel``, the argument its errors name).
AXIS_NAMES_ALLOWED = {
    "parallel/models/moe.py": {"context": "an NDArray's device (x.context)",
                               "as_in_context": "an NDArray copied to a device",
                               "expert_parallel": "check_shared's argument, named by its error"},
}


def _proxy_members():
    """The names the proxies and their protocol define themselves (methods, properties, ``self.`` attributes of
    ``ParallelF``, ``RanksF`` and ``ReplicasF``), beyond the ``mx.nd`` operators they pass on."""
    names = set()
    for module, classes in (("parallel/models/base.py", {"ParallelF"}),
                            ("parallel/models/layers.py", {"RanksF", "ReplicasF"})):
        with open(os.path.join(ROOT, module)) as f:
            tree = ast.parse(f.read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in classes):
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                    names.add(node.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                      and isinstance(node.ctx, ast.Store)):
                    names.add(node.attr)
    return names


def _proxy_uses(source, members):
    """``(line, name)`` of each use in ``source`` of a proxy member (``F.name``, ``name`` of ``members``) or of a
    proxy class itself (``RanksF``, ``ReplicasF``, ``Ranks``, imported or named)."""
    proxies = {"RanksF", "ReplicasF", "Ranks", "ParallelF"}
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "F"
                and node.attr in members):
            found.append((node.lineno, f"F.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in proxies:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.alias) and node.name in proxies:
            found.append((getattr(node, "lineno", 0), f"import {node.name}"))
    return sorted(found)


def test_a_model_file_holds_only_mathematics():
    """A model's blocks compute with ``F``'s ``mx.nd`` operators alone and reach the parallel forms through the seams
    (``parallel.models.base``: ``split_tokens(F, x)``, ``attention(F, ...)``, ``mixture(F, layer, ...)``): no
    ``F.context_part``, ``F.ring_attention``, ``F.sequence``, ``F.queues`` or other member of the proxies, and no
    proxy class (``ReplicasF``, ``RanksF``, ``Ranks``), in the model's code (issue 46)."""
    members = _proxy_members()
    assert {"split_tokens", "attention", "context_part", "ring_attention", "sequence", "context", "gather",
            "mixture", "queues", "expert_groups"} <= members
    old_moe = ("from .layers import Ranks, ReplicasF, RanksF\nif isinstance(F, ReplicasF):\n"
               "    queues = F.queues()\n    return Ranks(outputs, F)\n")
    assert _proxy_uses(old_moe, members) == [(1, "import Ranks"), (1, "import RanksF"), (1, "import ReplicasF"),
                                             (2, "ReplicasF"), (3, "F.queues"), (4, "Ranks")]
    found = [f"{module}:{line}: {name}" for module in MATHEMATICS_ONLY
             for line, name in _proxy_uses(open(os.path.join(ROOT, module)).read(), members)]
    assert not found, "call the seam of parallel.models.base instead:\n" + "\n".join(found)


#: Words of the parallel axes and their machinery, which no name in a model file's code holds (issue 46).
AXIS_WORDS = ("sequence", "context", "tensor", "ranks", "ring", "pipeline", "stage", "expert_parallel", "shard",
              "region", "replica")


def _axis_names(source):
    """``(line, name)`` of each name in ``source``'s code (a variable, attribute, keyword argument, function, class,
    import) that holds a word of ``AXIS_WORDS``; docstrings and comments are not code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = {ast.Name: lambda n: [n.id], ast.Attribute: lambda n: [n.attr], ast.keyword: lambda n: [n.arg or ""],
                 ast.FunctionDef: lambda n: [n.name], ast.ClassDef: lambda n: [n.name], ast.arg: lambda n: [n.arg],
                 ast.alias: lambda n: [n.name, n.asname or ""]}.get(type(node), lambda n: [])(node)
        found += [(getattr(node, "lineno", 0), name) for name in names
                  if any(word in name.lower() for word in AXIS_WORDS)]
    return sorted(found)


def test_a_model_file_names_no_axis():
    """A model file holds mathematics only: no layer told it is in the sequence region (``sequence=True``), no list
    of the arrays a layout sums (``sequence_region_params``), no name of an axis in its code; where the region lies
    is the proxy's and the model's plan's (``parallel.models.plan``)."""
    assert _axis_names("Dense(8, sequence=True)\ndef sequence_region_params(net): pass\nx = F.context\n") == [
        (1, "sequence"), (2, "sequence_region_params"), (3, "context")]
    found = [f"{module}:{line}: {name}" for module in MATHEMATICS_ONLY
             for line, name in _axis_names(open(os.path.join(ROOT, module)).read())
             if name not in AXIS_NAMES_ALLOWED.get(module, {})]
    assert not found, "say it in the model's plan (parallel/models/plan.py) or the proxy:\n" + "\n".join(found)
    stale = sorted(f"{module}: {name}" for module, names in AXIS_NAMES_ALLOWED.items() for name in names
                   if name not in {n for _, n in _axis_names(open(os.path.join(ROOT, module)).read())})
    assert not stale, "AXIS_NAMES_ALLOWED entries no model file needs any more (remove them): " + ", ".join(stale)


# ---- the benchmarks share one harness ----------------------------------------------------------------------------

#: What only ``benchmarks/harness.py`` does, and the helper each script uses instead.
_HARNESS_ONLY = {r"^import statistics|^import random": "harness.median / harness.round_orders",
                 r"\bjson\.dump\(|\batomic_write\(|\bos\.replace\(": "harness.write_json",
                 r"\bcheck_writable\(": "harness.results_path",
                 r"matplotlib\.pyplot|FigureCanvasAgg": "harness.figure / harness.save_figure",
                 r"\bsubprocess\.run\(": "harness.run_process",
                 r"def _int_list|def _median": "harness.CommaList / harness.median"}


def test_the_benchmark_scripts_share_the_harness():
    """Every script imports ``benchmarks/harness.py`` and none writes again what it holds: its own medians, rounds,
    int-list parsers, JSON writers, figures or child-process runners."""
    assert "benchmarks/harness.py" in [path.replace(os.sep, "/") for path in BENCHMARKS]
    found = []
    for path in BENCHMARKS:
        if os.path.basename(path) == "harness.py":
            continue
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        if not re.search(r"^import harness\b", source, re.M):
            found.append(f"{path}: does not import harness")
        found += [f"{path}: {pattern} (use {use})" for pattern, use in _HARNESS_ONLY.items()
                  if re.search(pattern, source, re.M)]
    assert not found, "\n".join(found)
