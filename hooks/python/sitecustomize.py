"""memshim's Python start-up hook (docs/pytorch.md).

libmemshim.so's constructor puts this directory first on PYTHONPATH in a CPython process that is
about to start, so CPython's `site` imports this module. It puts the user's PYTHONPATH back in
os.environ (children see what they would have seen), runs the sitecustomize this one shadows (the
user's, the venv's or the distribution's), and arms memshim's hook on `import torch`. It must
never stop the interpreter: any failure of memshim's own part is one line on stderr.
"""
import os
import sys


def _memshim_start():
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.pop("_MEMSHIM_PYTHONPATH", None)
    if saved is not None:
        if saved.startswith("1:"):
            os.environ["PYTHONPATH"] = saved[2:]
        else:
            os.environ.pop("PYTHONPATH", None)

    # memshim's directory goes to the end of sys.path: it stays importable (and its entry points
    # visible) without shadowing the program's own modules.
    def ours(p):
        try:
            return os.path.realpath(p or os.getcwd()) == here
        except OSError:
            return False
    if any(ours(p) for p in sys.path):
        sys.path[:] = [p for p in sys.path if not ours(p)] + [here]

    # The sitecustomize this module shadows, as site would have imported it.
    import importlib.machinery
    import importlib.util
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if not ours(p)])
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as exc:  # site.py's behaviour: report and go on
            if sys.flags.verbose:
                sys.excepthook(*sys.exc_info())
            else:
                print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}",
                      file=sys.stderr)

    try:
        pkg = os.path.dirname(here)
        if (os.path.basename(here) == "_startup" and os.path.isfile(os.path.join(pkg, "_boot.py"))
                and "memshim" not in sys.modules):
            # The pip package (docs/install.md): this directory is memshim/_startup inside the very
            # package it boots, which the program's interpreter may not have on its path (a python
            # from another environment): import that package by its location.
            spec = importlib.util.spec_from_file_location("memshim", os.path.join(pkg, "__init__.py"),
                                                          submodule_search_locations=[pkg])
            mod = importlib.util.module_from_spec(spec)
            sys.modules["memshim"] = mod
            try:
                spec.loader.exec_module(mod)  # arms the hook on `import torch`
            except BaseException:
                sys.modules.pop("memshim", None)
                raise
        else:
            import memshim  # noqa: F401  (arms the hook on `import torch`)
    except Exception as exc:  # noqa: BLE001
        print(f"memshim: the Python hook could not start ({type(exc).__name__}: {exc}); memshim stays in "
              "segment mode", file=sys.stderr)


_memshim_start()
del _memshim_start
