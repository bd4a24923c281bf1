"""The house rules of the package's layout, checked: every module says what it holds, no function is long, the
registries need no MXNet, and the commands take their choices from the registries."""
import ast
import os
import sys

import pytest

from conftest import ROOT, run_process

PACKAGE = os.path.join(ROOT, "parallel")
MODULES = sorted(os.path.relpath(os.path.join(d, n), ROOT) for d, _, names in os.walk(PACKAGE)
                 for n in names if n.endswith(".py"))

#: The most lines of code (not counting docstrings, comments and blank lines) a function may have.
MAX_FUNCTION_LINES = 60


def _code_lines(source, node):
    skip = set()
    if ast.get_docstring(node) is not None:
        skip = set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    lines = source.splitlines()[node.lineno - 1:node.end_lineno]
    return sum(1 for i, text in enumerate(lines, start=node.lineno)
               if text.strip() and not text.strip().startswith("#") and i not in skip)


@pytest.mark.parametrize("module", MODULES)
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
    choices = {action.dest: action.choices for action in build_parser()._actions}
    assert choices["allreduce"] == list(ALGORITHMS)
    assert choices["model"] == list(MODELS)
    assert choices["strategy"] == list(STRATEGIES)
    assert choices["dataset"] == list(DATASETS)


def test_a_submodule_never_hides_the_function_of_the_same_name():
    """``parallel.models.lenet`` is the network function whether or not its module was imported first."""
    code = ("import parallel.models.lenet\n"
            "import parallel.models\n"
            "from parallel.models import lenet\n"
            "assert callable(lenet) and lenet.__name__ == 'lenet', lenet\n"
            "assert parallel.models.lenet is lenet\n")
    result = run_process([sys.executable, "-c", code], timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
