"""Building the kernels' library (``kernels/build.py``): an ISA level chosen per machine, a build
directory two checkouts share, a stale lock removed, and a failed build tried again without OpenMP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from softprior.kernels import build

SRC = Path(build.__file__).resolve().parents[1]  # src/softprior


def test_the_isa_is_a_level_this_cpu_runs_and_a_bad_request_is_one_line(monkeypatch):
    native = build.native_isa()
    assert native in build.ISA_FLAGS
    monkeypatch.setenv(build.ISA_ENV, "native")
    assert build.requested_isa() == native
    monkeypatch.setenv(build.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="choose one of native") as e:
        build.requested_isa()
    assert "\n" not in str(e.value)
    monkeypatch.setattr(build, "native_isa", lambda: "avx2")
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="this CPU runs avx2, generic"):
        build.requested_isa()


def test_the_levels_need_every_flag_of_their_level(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    flags = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags | {"avx512f"})  # AVX-512 F alone is not x86-64-v4
    assert build.native_isa() == "avx2"
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags - {"fma"})
    assert build.native_isa() == "generic"
    monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
    assert build.native_isa() == "neon"


def test_a_failed_build_is_tried_again_without_openmp_then_for_the_default_target(monkeypatch, tmp_path, capsys):
    """clang on macOS has no ``-fopenmp``: the build is tried again without it, then without the ISA
    flags, and says which it chose."""
    from torch.utils import cpp_extension
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv(build.ISA_ENV, "avx2" if build.native_isa() in ("avx2", "avx512") else "generic")
    tried = []

    def load(name, sources, extra_cflags, extra_ldflags, **kw):
        tried.append(extra_cflags)
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("Error building extension: clang: error: unsupported option '-fopenmp'")
    monkeypatch.setattr(cpp_extension, "load", load)
    assert "without OpenMP" in build.build_library()
    assert ["-fopenmp" in f for f in tried] == [True, False]
    err = capsys.readouterr().err
    assert "unsupported option '-fopenmp'" in err and "trying again without OpenMP" in err
    tried.clear()

    def never(name, sources, extra_cflags, extra_ldflags, **kw):
        tried.append(extra_cflags)
        raise RuntimeError("c++: not found")
    monkeypatch.setattr(cpp_extension, "load", never)
    with pytest.raises(RuntimeError, match="not found"):
        build.build_library()
    assert len(tried) == len(build._attempts(build.requested_isa()))


def test_a_lock_held_by_a_killed_process_does_not_block_the_next_build(tmp_path):
    """The OS lock dies with its process; the lock file of ``cpp_extension`` that a killed build leaves
    (every later process waited on it for ever) is removed under it."""
    d = tmp_path / "lib"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; from pathlib import Path; d = Path(sys.argv[1]); d.mkdir(parents=True); "
        "f = open(d / 'softprior.flock', 'w'); fcntl.flock(f, fcntl.LOCK_EX); (d / 'lock').write_text(''); "
        "print('held', flush=True); time.sleep(600)"), str(d)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with build._locked(d):
        assert not (d / "lock").exists()
    assert time.monotonic() - t0 < 60  # (a hang, not a speed: the lock would be held for 600 s)


def _checkout(root: Path) -> Path:
    dst = root / "src"
    shutil.copytree(SRC, dst / "softprior", ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _load(src: Path, ext: Path, *, lock: bool = False) -> subprocess.CompletedProcess:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from softprior import kernels; "
            "assert kernels.available(), kernels.build_error(); print(kernels.isa())")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    env.pop(build.ISA_ENV, None)
    return subprocess.run([sys.executable, "-c", code, str(src)], env=env, capture_output=True, text=True, timeout=900)


def test_two_checkouts_share_one_build_and_a_stale_lock_file_is_removed(tmp_path):
    """Two checkouts of one commit load each other's build (ninja rebuilt when only the sources' paths
    differed: 60-100 s each time they alternated); a ``lock`` file left by a killed build is removed
    with one line instead of a silent wait."""
    ext = tmp_path / "ext"
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    first = _load(a, ext)
    assert first.returncode == 0 and "building the fused kernels" in first.stderr, first.stderr[-2000:]
    (lib,) = list(ext.rglob("softprior_kernels_*.so"))
    built = lib.stat().st_mtime_ns
    for src in (b, a):
        again = _load(src, ext)
        assert again.returncode == 0 and "building" not in again.stderr, again.stderr[-2000:]
    assert lib.stat().st_mtime_ns == built
    (lib.parent / "lock").write_text("")  # what a build killed in cpp_extension's critical section leaves
    stale = _load(b, ext)
    assert stale.returncode == 0 and "removing the lock file a killed build left" in stale.stderr
    assert not (lib.parent / "lock").exists()
