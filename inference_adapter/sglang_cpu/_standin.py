"""Inert stand-in modules for packages that cannot be installed on a CPU machine.

``install(name, module)`` makes every ``name.*`` submodule importable; every attribute of these modules
is a placeholder class whose construction or call raises, so code that only imports them works and code
that really uses them fails loudly instead of computing nonsense.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return make(f"{cls.__name__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def make(name: str) -> type:
    """A placeholder class named ``name`` that refuses to be constructed or called."""

    def _refuse(*a, **k):
        raise RuntimeError(f"stand-in: {name} is not available on a CPU host (a stand-in of inference_adapter/sglang_cpu)")

    return _StubMeta(name, (), {"__init__": _refuse, "__call__": _refuse})


def module_getattr(modname: str):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return make(f"{modname}.{name}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix: str):
        self.prefix = prefix + "."

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = module_getattr(spec.name)
        return m

    def exec_module(self, module):
        pass


def install(name: str, module_globals: dict) -> None:
    """Turn the package ``name`` (whose ``__init__`` calls this) into a stand-in."""
    sys.meta_path.insert(0, _Finder(name))
    module_globals["__getattr__"] = module_getattr(name)
