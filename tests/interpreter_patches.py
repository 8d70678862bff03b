"""Triton's interpreter, made cheaper for our kernels' device-function calls (test processes
only; the kernels and what they compute are untouched).

Triton 3.9's interpreter re-patches `triton.language` on every call of a @triton.jit helper
(`InterpretedFunction.__call__` -> `_patch_lang`, an `inspect.getmembers` over the language's
modules each time), although the kernel's launch (`GridExecutor.__call__`) has patched the same
modules for the whole launch and restores them at its end. Our kernels call helpers per item,
so in a profile of a 3-rank interpreted run that re-patching was 91 of 137 s (session 31).
`skip_nested_language_patches` patches each language module at most once per launch: a
helper's patch is skipped where the launch, or an earlier helper of the same launch, has
patched its modules (triton.language for our kernels, triton.language.core for Triton's own
`tl.max`, `tl.sum`, ...). Triton never restores a helper's patch, and nothing restores anything
within a launch, so a repeated patch there changes nothing. Anything unexpected in Triton's
interpreter (another version's internals) leaves it as it is: slower, not different.
"""

from __future__ import annotations

import functools
import inspect

# What Triton 3.9's InterpretedFunction.__call__ does, line by line after its `def`: the body
# that `call_unpatched` repeats. Any other body and nothing is installed.
_BODY = ["_patch_lang(self.fn)", "fn = self.rewrite()", "try:", "return fn(*args, **kwargs)",
         "except Exception as e:", "raise InterpreterError(repr(e)) from e"]


@functools.cache
def _languages(fn) -> frozenset:
    import triton.language as tl
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def skip_nested_language_patches() -> bool:
    """Installs the skip; False where this Triton's interpreter is not the one it was made for."""
    try:
        from triton.runtime import interpreter
        launch, call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
        patch, error = interpreter._patch_lang, interpreter.InterpreterError
    except (ImportError, AttributeError):
        return False
    if getattr(call, "skips_nested_patches", False):
        return True
    lines = [line.strip() for line in inspect.getsource(call).splitlines()[1:]]
    if [line for line in lines if line and not line.startswith("#")] != _BODY:
        return False
    patched: list[set] = []  # the running launches' patched language modules, innermost last

    @functools.wraps(launch)
    def launch_patched(self, *args, **kwargs):
        patched.append(set(_languages(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    @functools.wraps(call)
    def call_unpatched(self, *args, **kwargs):
        # Triton 3.9's body of InterpretedFunction.__call__, its _patch_lang made conditional
        languages = _languages(self.fn)
        if not patched or not languages <= patched[-1]:
            patch(self.fn)
            if patched:
                patched[-1] |= languages
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    call_unpatched.skips_nested_patches = True
    interpreter.GridExecutor.__call__ = launch_patched
    interpreter.InterpretedFunction.__call__ = call_unpatched
    return True
