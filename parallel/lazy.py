"""Names that load their module on first use, so that a package imports MXNet only when it is needed.

``parallel`` and its sub-packages (``comm``, ``models``, ``data``, ``strategies``) hold, in their
``__init__``, what can be known without MXNet (the names of the allreduce algorithms, of the models, of the
datasets, of the strategies) and re-export the rest lazily: ``python -m parallel.train --help`` and every
argument error answer before MXNet starts (it takes about a second to load), and the command can still set
``OMP_NUM_THREADS`` before MXNet reads it.

A submodule may share its name with the function it defines (``parallel.models.lenet`` defines ``lenet``):
the package's attribute is always the exported function, never the submodule, whichever is imported first
(``sys.modules["parallel.models.lenet"]`` is the module).
"""
import importlib
import sys
import types

__all__ = ["lazy_exports"]


#: ``{package: {name: submodule}}`` of every package that called ``lazy_exports``: kept here, not on the package.
_EXPORTS = {}


class _LazyPackage(types.ModuleType):
    """A package whose exported names win over its submodules of the same name.

    Importing ``package.name`` makes Python set the attribute ``name`` of the package to the submodule; when
    ``name`` is one of the package's exports, the export defined in that submodule is stored instead.
    """

    def __setattr__(self, name, value):
        exports = _EXPORTS.get(self.__name__, {})
        if (name in exports and isinstance(value, types.ModuleType)
                and value.__name__ == f"{self.__name__}.{name}" and hasattr(value, name)):
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(package, sources):
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) for names defined in its submodules.

    Call it from the package's ``__init__``: ``__getattr__, __dir__ = lazy_exports(__name__, {...})``.

    Parameters
    ----------
    package : str
        The package's ``__name__`` (already in ``sys.modules``, as it is while its ``__init__`` runs).
    sources : dict
        ``{submodule: [name, ...]}``: where each name is defined, relative to ``package``.

    Returns
    -------
    (callable, callable)
        ``__getattr__(name)`` imports the submodule that defines ``name`` and returns the name (cached in the
        package afterwards); ``__dir__()`` lists the package's names and the lazy ones.
    """
    module_of = {name: module for module, names in sources.items() for name in names}
    target = sys.modules[package]
    target.__class__ = _LazyPackage
    _EXPORTS[package] = module_of

    def __getattr__(name):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(target, name, value)
        return value

    def __dir__():
        return sorted(set(vars(target)) | set(module_of))

    return __getattr__, __dir__
