"""Triton's interpreter, made cheaper for our kernels' device-function calls, and its 2-byte
loads and stores made whole (test processes only; the kernels and what they compute are
untouched). `install` puts both in place.

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

import numpy as np

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


# ---- whole 2-byte copies --------------------------------------------------------------------
#
# Triton 3.9's interpreter loads and stores each element with libc memcpy of the element's size,
# and glibc 2.36's memcpy does not copy 2 bytes in one access. So a 2-byte element that another
# process stores meanwhile can be read torn, half old and half new. Measured here: 99,322 torn of
# 62 M loads of an element that a C loop kept switching between 0x8000 and 0x1234; none through
# the numpy copies below. The GPU's 16-bit accesses are whole, and our Lamport kernels rely on
# it: a place reads as empty (-0.0, 0x8000) or as the stored value. Torn, the empty pattern's
# high byte with a value's low byte is a tiny negative number that is not empty, so the reader
# took it, and one source's share dropped out of a sum (session 35: a CPU-CI failure of the
# one-shot Lamport kernel, bf16, one element of one rank, that did not come back in 9 reruns).
# numpy copies a 2-byte element in one access.


class _Span:
    """`count` uint16 at address `base`, as numpy reads memory it does not own."""

    def __init__(self, base: int, count: int):
        self.__array_interface__ = {"shape": (count,), "typestr": "<u2", "data": (base, False),
                                    "version": 3}


def _places(addresses: np.ndarray):
    """A uint16 view of memory from the lowest of `addresses` (all 2-byte aligned) to the
    highest, and each address's index in it."""
    base = int(addresses.min())
    memory = np.asarray(_Span(base, int(addresses.max() - base) // 2 + 1))
    return memory, ((addresses - base) // 2).astype(np.intp)


class _WholeTwoByteCopies:
    """Triton's C++ interpreter module, its load and store of 2-byte elements done by numpy."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def load(self, ptrs, mask, other, dtype):
        if np.dtype(dtype).itemsize != 2:
            return self._module.load(ptrs, mask, other, dtype)
        out = np.array(np.broadcast_to(other, ptrs.shape), dtype=dtype)
        wanted = np.broadcast_to(mask, ptrs.shape)
        if wanted.any():
            memory, index = _places(ptrs[wanted])
            out.view(np.uint16)[wanted] = memory[index]
        return out

    def store(self, ptrs, value, mask):
        if value.dtype.itemsize != 2:
            return self._module.store(ptrs, value, mask)
        wanted = np.broadcast_to(mask, ptrs.shape)
        if wanted.any():
            memory, index = _places(ptrs[wanted])
            values = np.ascontiguousarray(np.broadcast_to(value, ptrs.shape))
            memory[index] = values.view(np.uint16)[wanted]


def whole_two_byte_copies() -> bool:
    """Installs the whole copies; False where this Triton has no such interpreter module."""
    try:
        from triton.runtime import interpreter
        module = interpreter._interpreter
    except (ImportError, AttributeError):
        return False
    if not isinstance(module, _WholeTwoByteCopies):
        interpreter._interpreter = _WholeTwoByteCopies(module)
    return True


def install() -> None:
    """Both patches, in a process that runs interpreted kernels."""
    skip_nested_language_patches()
    whole_two_byte_copies()
