"""Names that load their module on first use, so that a package imports MXNet only when it is needed.

``parallel`` and its sub-packages (``comm``, ``models``, ``data``, ``strategies``) hold, in their
``__init__``, what can be known without MXNet (the names of the allreduce algorithms, of the models, of the
datasets, of the strategies), and re-export the rest lazily: ``python -m parallel.train --help`` and every
argument error answer before MXNet starts (it takes about a second to load), and the command can still set
``OMP_NUM_THREADS`` before MXNet reads it.

>>> getattr_, dir_ = lazy_exports("json", {"decoder": ["JSONDecodeError"]})
>>> getattr_("JSONDecodeError").__name__
'JSONDecodeError'
"""
import importlib

__all__ = ["lazy_exports"]


def lazy_exports(package, sources):
    """A module's ``__getattr__`` and ``__dir__`` (PEP 562) for names defined in its submodules.

    Parameters
    ----------
    package : str
        The module's ``__name__``.
    sources : dict
        ``{submodule: [name, ...]}``: where each name is defined, relative to ``package``.

    Returns
    -------
    (callable, callable)
        ``__getattr__(name)`` imports the submodule that defines ``name`` and returns it (cached in the
        module's namespace afterwards); ``__dir__()`` lists the module's names and the lazy ones.
    """
    module_of = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(importlib.import_module(package))[name] = value
        return value

    def __dir__():
        return sorted(set(vars(importlib.import_module(package))) | set(module_of))

    return __getattr__, __dir__
