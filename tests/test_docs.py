"""Executed documentation: every code block and command in README.md, and every docstring example, runs.

- A ```python block of README.md runs as it is written, in a fresh namespace and an empty working
  directory; a ```text block right after it is its expected output (``...`` stands for any text).
- A ``$ python -m parallel.train ...`` command of README.md or of a module docstring runs for one epoch
  (``--epochs 1`` appended) on a tiny MNIST-format set in ``$MXNET_HOME``; GPU commands must fail cleanly
  on a machine without GPUs.
- A ``$ python benchmarks/NAME.py ...`` command must name a script that exists, and each of its flags
  must be one the script's ``--help`` lists (the benchmarks themselves have smoke tests).
- The install and test commands are what ``.ci/run`` runs.
- Docstring examples are doctests, run by ``--doctest-modules`` (setup.cfg); a ``::`` literal block of
  Python code in a docstring would not run, so none is allowed.
"""
import ast
import contextlib
import doctest
import io
import os
import re
import shlex
import subprocess
import sys

import mxnet as mx
import pytest

from conftest import easy_dataset, write_idx_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PACKAGE = os.path.join(ROOT, "parallel")


def fenced_blocks(text):
    """(language, code, line number) of every fenced block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = re.match(r"^```(\w*)\s*$", lines[i])
        if match:
            start, i = i + 1, i + 1
            while not lines[i].startswith("```"):
                i += 1
            blocks.append((match.group(1), "\n".join(lines[start:i]) + "\n", start + 1))
        i += 1
    return blocks


def readme_examples():
    """Each ```python block of the README with the ```text block that follows it, if any."""
    blocks = fenced_blocks(open(README).read())
    examples = []
    for n, (lang, code, line) in enumerate(blocks):
        if lang == "python":
            following = blocks[n + 1] if n + 1 < len(blocks) else None
            expected = following[1] if following and following[0] == "text" else None
            examples.append(pytest.param(code, expected, line, id=f"README.md:{line}"))
    return examples


def readme_commands():
    """The ``$ command`` lines of the README, at any indentation (in recorded output blocks too)."""
    return [re.sub(r"^\s*\$ ", "", line).split("  #")[0].strip()
            for line in open(README).read().splitlines() if re.match(r"^\s*\$ ", line)]


def docstring_commands():
    """``python -m parallel.train ...`` lines in the package's module docstrings, under the launcher too."""
    found = []
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, name)).read())) or ""
            found += [(name, line.strip()) for line in doc.splitlines()
                      if line.strip().startswith("python -m parallel.train")
                      or (line.strip().startswith("python -m parallel.launch") and "parallel.train" in line)]
    return found


def test_the_readme_has_examples_and_commands():
    assert len(readme_examples()) >= 3
    assert any(c.startswith("python -m parallel.train") for c in readme_commands())


@pytest.mark.parametrize("code, expected, line", readme_examples())
def test_readme_python_block_runs_as_written(code, expected, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n" * (line - 1) + code, README, "exec"), {"__name__": "__readme__"})   # errors name README lines
    mx.nd.waitall()
    if expected is not None:
        checker = doctest.OutputChecker()
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        assert checker.check_output(expected, out.getvalue(), flags), (
            f"README shows:\n{expected}\nbut the block printed:\n{out.getvalue()}")


@pytest.fixture(scope="module")
def tiny_mxnet_home(tmp_path_factory):
    """``$MXNET_HOME`` with a tiny learnable MNIST-format set where Fashion-MNIST would be downloaded."""
    home = tmp_path_factory.mktemp("mxnet_home")
    directory = home / "datasets" / "fashion-mnist"
    directory.mkdir(parents=True)
    write_idx_files(directory, easy_dataset(num_train=300, num_test=100, seed=2))
    return home


def _run_launched_train_command(words, home, tmp_path):
    """``python -m parallel.launch ... python -m parallel.train ...``: the whole job, one epoch."""
    i = next(i for i in range(len(words)) if words[i:i + 3] == ["python", "-m", "parallel.train"])
    argv = [sys.executable, *words[1:i], "--stall-timeout", "120", sys.executable, *words[i + 1:], "--epochs", "1",
            "--no-progress"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=dict(os.environ, MXNET_HOME=str(home)))
    assert result.returncode == 0, (words, result.stderr[-3000:])
    assert sum(" epoch 1, loss " in line for line in result.stdout.splitlines()) == 1, result.stdout


def _run_train_command(command, home, tmp_path, monkeypatch, capsys):
    from parallel.train import main
    words = shlex.split(command)
    if words[:3] == ["python", "-m", "parallel.launch"]:
        return _run_launched_train_command(words, home, tmp_path)
    assert words[:3] == ["python", "-m", "parallel.train"], command
    monkeypatch.setenv("MXNET_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    status = main(words[3:] + ["--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err
    wants_gpu = any(w.startswith("gpu") for w in words)
    if wants_gpu and mx.context.num_gpus() == 0:
        assert status == 2 and "GPU" in err, (command, err)
    else:
        assert status == 0, (command, err)


def _classify(command):
    words = shlex.split(command)
    while words and re.match(r"^\w+=", words[0]):   # environment assignments such as OMP_NUM_THREADS=2
        words = words[1:]
    if words[:3] == ["python", "-m", "parallel.train"]:
        return "train"
    if words[:3] == ["python", "-m", "parallel.launch"] and "parallel.train" in words:
        return "train"   # a training job: in order with the other training commands
    if words[:3] == ["python", "-m", "parallel.launch"]:
        return "launch"
    if words[:2] == ["python", "-m"] and words[2:3] == ["pytest"]:
        return "test"
    if words[:2] == ["pip", "install"]:
        return "install"
    if len(words) >= 2 and words[0] == "python" and words[1].startswith("benchmarks/"):
        return "benchmark"
    return "unknown"


def test_readme_train_commands_run_in_order(tiny_mxnet_home, tmp_path, monkeypatch, capsys):
    """Every ``python -m parallel.train`` command of the README, in the README's order and in one directory,
    as a user runs them (a ``--resume`` continues the checkpoint an earlier command wrote)."""
    commands = [c for c in readme_commands() if _classify(c) == "train"]
    assert commands
    for command in commands:
        _run_train_command(command, tiny_mxnet_home, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("command", [c for c in readme_commands() if _classify(c) != "train"])
def test_readme_command_runs(command, tiny_mxnet_home, tmp_path, monkeypatch, capsys):
    kind = _classify(command)
    assert kind != "unknown", f"README command {command!r}: tests/test_docs.py does not know how to check it"
    if kind == "launch":   # a whole kvstore job through the launcher, as written
        words = shlex.split(command)
        result = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=180,
                                cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert sum(line.startswith("[worker ") for line in result.stdout.splitlines()) >= 1, result.stdout
    elif kind == "benchmark":
        words = shlex.split(command)
        while re.match(r"^\w+=", words[0]):
            words = words[1:]
        script = os.path.join(ROOT, words[1])
        assert os.path.isfile(script), f"{command!r}: no such script"
        help_text = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                                   timeout=120, cwd=ROOT)
        assert help_text.returncode == 0, help_text.stderr
        for flag in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
            assert flag in help_text.stdout, f"{command!r}: {flag} is not a flag of {words[1]}"
    elif kind == "install":
        if "mxnet-cu" in command:
            pytest.skip("installs MXNet's CUDA build: needs a GPU machine")
        ci = open(os.path.join(ROOT, ".ci", "run")).read()
        assert "pip install" in ci and command == readme_commands()[0], "CI runs the README's first install"
        assert re.search(r"pip install -e '\.\[test\]'", command), command
    else:
        assert "python -m pytest" in open(os.path.join(ROOT, ".ci", "run")).read()


@pytest.mark.parametrize("module, command", docstring_commands())
def test_docstring_command_runs(module, command, tiny_mxnet_home, tmp_path, monkeypatch, capsys):
    _run_train_command(command, tiny_mxnet_home, tmp_path, monkeypatch, capsys)


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield getattr(node, "name", "<module>"), doc


def test_docstring_examples_are_doctests_not_literal_blocks():
    """A ``::`` block of Python in a docstring is never run; examples must be ``>>>`` doctests instead.
    Literal blocks of shell commands (``python -m ...``) are allowed: test_docstring_command_runs runs them."""
    offenders = []
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            for owner, doc in _docstrings(ast.parse(open(path).read())):
                for block in re.findall(r"::\n\n((?:    .*\n?|\n)+)", doc):
                    lines = [l.strip() for l in block.splitlines() if l.strip()]
                    if not all(l.startswith(("python -m ", "$ ")) for l in lines):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{owner}")
    assert not offenders, f"docstring examples that never run (make them >>> doctests): {offenders}"
