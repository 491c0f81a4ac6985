"""Building the kernels' library (``attention.cpp`` and ``step.cpp``, sharing ``blocks.h``) at first use.

The library is compiled by ``torch.utils.cpp_extension.load`` (g++ or clang, and ninja) once per
machine, ISA, torch and source: a later process loads the cached build.

ISA. The kernels' inner loops are written once (``blocks.h``), on tiles of 16 lanes held in the
registers of the ISA the build targets (``Native``): one AVX-512 register, two AVX2 registers, four
NEON or SSE2 registers, in one order, so every ISA gives the kernels' bits. The target is an ISA level, not the build machine's every flag
(``-march=native``), so the same level gives the same code on every CPU that has it:

- ``avx512``: ``-march=x86-64-v4`` (AVX-512 F, BW, CD, DQ, VL), where layer 0's gathers are one
  two-table permute each (``blocks.h``, ``gather_tiles``);
- ``avx2``: ``-march=x86-64-v3`` (AVX2, FMA, BMI2);
- ``neon``: an ARM64 CPU's default (Advanced SIMD is part of ARMv8-A);
- ``generic``: the compiler's default for the machine (x86-64: SSE2).

``SOFTPRIOR_ISA`` chooses one (``softprior bench`` builds and times ``avx2`` beside the native one on
an AVX-512 host); the default is the best the CPU runs (``native_isa``). ``isa()`` names the one in
use: every run records it (``provenance``), since another ISA's build and ATen's kernels for it
round otherwise in the last bits (docs/DESIGN.md, "Bit-identity").

Builds a user never waits on blindly:
- the build directory is keyed by the library's name (ISA, torch, a digest of the sources), and the
  sources are copied into it, so two checkouts of one commit compile the same files at the same paths
  and load each other's build (ninja rebuilt when only the paths differed);
- one line on stderr says that the library is being built, the first time;
- the build holds an OS file lock (``fcntl.flock``: released by the kernel when its process dies),
  and under it removes the lock file a killed build of ``cpp_extension`` left behind (``lock``: every
  later process waited on it for ever, without a word);
- a build that fails is tried again without OpenMP (clang on macOS has none: the blocks then run in
  one thread), then without the ISA flags, before the pure-PyTorch path is chosen; each step says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

__all__ = ["ISA_ENV", "ISA_FLAGS", "native_isa", "requested_isa", "build_library", "build_dir", "one_line"]

ISA_ENV = "SOFTPRIOR_ISA"  # avx512, avx2, neon, generic, or native (the default: the best this CPU runs)
ISA_FLAGS = {"avx512": ["-march=x86-64-v4", "-mtune=generic"], "avx2": ["-march=x86-64-v3", "-mtune=generic"], "neon": [], "generic": []}
_HERE = Path(__file__).parent
SOURCES = (_HERE / "attention.cpp", _HERE / "step.cpp")  # one library: the attention operator and the whole step
HEADERS = (_HERE / "blocks.h",)
_BASE_FLAGS = ["-O3", "-ffp-contract=fast", "-fno-tree-loop-distribute-patterns"]

# the CPU flags each x86 level needs (as /proc/cpuinfo names them)
_X86_LEVELS = {"avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"},
               "avx2": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_isa() -> str:
    """The best ISA level this CPU runs: avx512, avx2 or generic on x86-64, neon on ARM64."""
    machine = platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        return "neon"
    flags = _cpu_flags()
    for isa in ("avx512", "avx2"):
        if _X86_LEVELS[isa] <= flags:
            return isa
    return "generic"


def requested_isa() -> str:
    """The ISA the library is built for: ``SOFTPRIOR_ISA`` (``native`` or unset: ``native_isa()``).
    One the CPU cannot run is refused with a one-line error naming what it can."""
    want = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    native = native_isa()
    if want == "native":
        return native
    if want not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={want!r}: choose one of native, {', '.join(ISA_FLAGS)}")
    runnable = {"avx512": ["avx512", "avx2", "generic"], "avx2": ["avx2", "generic"], "neon": ["neon", "generic"],
                "generic": ["generic"]}[native]
    if want not in runnable:
        raise ValueError(f"{ISA_ENV}={want}: this CPU runs {', '.join(runnable)}")
    return want


def source_tag() -> str:
    """A digest of the sources and the header they share (an edit of either names a new build)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))).hexdigest()[:10]


def _library_name(isa: str, variant: str) -> str:
    import torch
    torch_tag = torch.__version__.split("+")[0].replace(".", "_")
    return f"softprior_kernels_{isa}{variant}_t{torch_tag}_{source_tag()}"


def build_dir(name: str) -> Path:
    """``$TORCH_EXTENSIONS_DIR`` (default ~/.cache/torch_extensions) / softprior / the library's name."""
    from torch.utils.cpp_extension import get_default_build_root
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "softprior" / name


def _ensure_ninja() -> None:
    """``cpp_extension.load`` runs ``ninja`` from PATH: where it is not there, the ``ninja`` package's
    binary (a dependency of softprior) is put at PATH's end."""
    if shutil.which("ninja") is None:
        try:
            import ninja
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + ninja.BIN_DIR
        except ImportError:
            pass


@contextlib.contextmanager
def _locked(directory: Path):
    """An OS lock on ``directory``'s build (released by the kernel if this process dies), under which a
    stale ``lock`` file of ``cpp_extension`` (left by a killed build) is removed: no other build of
    softprior can hold it while this process holds the OS lock."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # (Windows: no flock; cpp_extension's own lock file alone)
        yield
        return
    with open(directory / "softprior.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                print(f"softprior: removing the lock file a killed build left ({stale})", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _copy_sources(directory: Path) -> list[str]:
    """The sources copied into ``directory``/src (unchanged files left as they are): every checkout
    then compiles the same paths."""
    src = directory / "src"
    src.mkdir(exist_ok=True)
    out = []
    for p in (*SOURCES, *HEADERS):
        dst = src / p.name
        data = p.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = dst.with_suffix(dst.suffix + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
        if p in SOURCES:
            out.append(str(dst))
    return out


def _attempts(isa: str) -> list[tuple[str, list[str], list[str]]]:
    """(variant, cflags, ldflags) to try in order: the ISA with OpenMP, without OpenMP, then the
    compiler's default target without OpenMP."""
    flags = ISA_FLAGS[isa]
    tries = [("", [*_BASE_FLAGS, *flags, "-fopenmp"], ["-fopenmp"]), ("-noomp", [*_BASE_FLAGS, *flags], [])]
    if flags:
        tries.append(("-default", list(_BASE_FLAGS), []))
    return tries


def build_library() -> str:
    """Compile (or load the cached build of) the kernels' library for ``requested_isa()``; returns a
    description of what was built (the ISA, and what it lacks where a flag had to be dropped). Raises
    with the last attempt's error where every attempt failed."""
    from torch.utils import cpp_extension
    _ensure_ninja()
    isa = requested_isa()
    error, attempts = None, _attempts(isa)
    for i, (variant, cflags, ldflags) in enumerate(attempts):
        name = _library_name(isa, variant)
        directory = build_dir(name)
        with _locked(directory):
            sources = _copy_sources(directory)
            if not (directory / f"{name}.so").exists():
                what = isa if not variant else f"{isa} ({variant[1:]})"
                print(f"softprior: building the fused kernels for {what} (first use on this machine, about a minute)",
                      file=sys.stderr, flush=True)
            try:
                cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=ldflags,
                                   build_directory=str(directory), is_python_module=False, verbose=False)
            except Exception as exc:  # a compile or link error: the next attempt drops a flag
                error = exc
                if i + 1 < len(attempts):
                    print(f"softprior: the kernels' build failed ({one_line(exc)}); trying again "
                          f"{'without OpenMP' if i == 0 else 'for the default target'}", file=sys.stderr, flush=True)
                continue
        described = {"": isa, "-noomp": f"{isa} without OpenMP (one thread per block)",
                     "-default": "the compiler's default target without OpenMP"}[variant]
        if variant:
            print(f"softprior: the fused kernels run, built for {described}", file=sys.stderr, flush=True)
        return described
    raise error  # type: ignore[misc]


def one_line(exc: BaseException) -> str:
    """An exception as one line: a compiler's first ``error:`` line where the build printed one."""
    text = str(exc)
    errors = [ln.strip() for ln in text.splitlines() if "error:" in ln]
    return f"{type(exc).__name__}: " + (errors[0] if errors else (text.splitlines() or [""])[0])[:300]
