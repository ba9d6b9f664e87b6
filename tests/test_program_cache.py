"""The program cache (NOTE [program cache]): compiled programs kept on disk, so that a new
process (or a new plait.jit of the same function) traces and compiles nothing else."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import plait
from plait.backends import codegen, cpp, program_cache
from plait.passes import lowering


def f(x, i):
    """Kernels (softmax), externs (gather, matmul, lu) and a constant."""
    return torch.softmax(x, -1).gather(1, i) * 2, torch.linalg.det(x[:, :4] @ x[:, :4].T)


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 9, generator=g), torch.randint(0, 9, (6, 3), generator=g)


@pytest.fixture
def lowerings(monkeypatch, tmp_path):
    """A cache folder of the test's own; the list of graphs lowered (compiled) so far."""
    calls, real = [], lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda graph, **kw: calls.append(graph) or
                        real(graph, **kw))
    with plait.config.patch(cache_dir=str(tmp_path)):
        yield calls


def g(x, i):
    """Another program of the same inputs."""
    return torch.softmax(x, 0).gather(1, i) - 1, torch.linalg.det(x[:, 4:8] @ x[:, 4:8].T)


def check(jitted, fn=f):
    for got, want in zip(jitted(*inputs()), fn(*inputs())):
        torch.testing.assert_close(got, want)


def test_a_new_jit_of_a_function_compiles_nothing(lowerings):
    check(plait.jit(f, backend="cpp"))
    assert len(lowerings) == 1
    check(plait.jit(f, backend="cpp"))
    assert len(lowerings) == 1  # traced, then loaded from the disk


_PROCESS = """
import json, os, sys, time, torch, plait
def f(x, i):
    return torch.softmax(x, -1).gather(1, i) * 2, torch.linalg.det(x[:, :4] @ x[:, :4].T)
x, i = torch.randn(6, 9), torch.randint(0, 9, (6, 3))
barrier, n = sys.argv[1:]
open(os.path.join(barrier, str(os.getpid())), "w").close()
while len(os.listdir(barrier)) < int(n):  # all processes imported: start together
    time.sleep(0.01)
for got, want in zip(plait.jit(f, backend="cpp")(x, i), f(x, i)):
    torch.testing.assert_close(got, want)
print(json.dumps({"lowered": "plait.passes.lowering" in sys.modules}))
"""


def _processes(cache_dir, n: int) -> list[dict]:
    """Run ``_PROCESS`` in ``n`` processes at once; what each printed."""
    env = dict(os.environ, PLAIT_CACHE_DIR=str(cache_dir))
    barrier = tempfile.mkdtemp(dir=cache_dir)
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, barrier, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    return [json.loads(out.splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow  # fresh processes import torch and compile: most of a minute
def test_a_new_process_compiles_nothing_it_compiled_before(tmp_path):
    # two processes compiling one function at once both succeed (atomic writes); which of
    # them finds the other's program already written is up to the scheduler
    assert {"lowered": True} in _processes(tmp_path, 2)
    assert len(os.listdir(tmp_path / "programs")) == 1
    # lowering (and every pass after it) is not even imported
    assert _processes(tmp_path, 1) == [{"lowered": False}]
    # an entry whose library is gone: compiled again
    for name in os.listdir(tmp_path / "cpp"):
        if os.path.isfile(tmp_path / "cpp" / name):  # not a build in progress (the runtime's)
            os.remove(tmp_path / "cpp" / name)
    assert _processes(tmp_path, 1) == [{"lowered": True}]


def test_donations_are_part_of_the_key(lowerings):
    def sgd(w, g):
        return w - 0.1 * g

    w, g = torch.randn(8, 4), torch.randn(8, 4)
    plait.jit(sgd, backend="cpp", donate_argnums=0)(w.clone(), g.clone())
    before = w.clone()
    out = plait.jit(sgd, backend="cpp", donate_argnums=1)(w, g.clone())
    assert torch.equal(w, before)  # the program writing into argument 0 was not taken
    torch.testing.assert_close(out, sgd(before, g))
    assert len(lowerings) == 2


def test_settings_that_change_the_program_are_part_of_the_key(lowerings):
    check(plait.jit(f, backend="cpp"))
    with plait.config.patch(inplace=False):
        check(plait.jit(f, backend="cpp"))
    assert len(lowerings) == 2


def _entries(tmp_path) -> list:
    return [tmp_path / "programs" / name for name in os.listdir(tmp_path / "programs")]


def _with_payload(entry, payload: bytes) -> None:
    """``entry`` (a path) holding ``payload`` under its own key, with a valid header."""
    magic, key = entry.read_bytes().split(b"\n")[:2]
    entry.write_bytes(b"\n".join([magic, key, hashlib.sha256(payload).hexdigest().encode(),
                                  payload]))


@pytest.mark.parametrize("damage", ["truncated", "garbled", "pickle", "library"])
def test_a_damaged_entry_is_compiled_again_and_replaced(lowerings, tmp_path, damage):
    check(plait.jit(f, backend="cpp"))
    (entry,) = _entries(tmp_path)
    data = entry.read_bytes()
    if damage == "pickle":
        _with_payload(entry, b"not a pickle")
    elif damage == "library":  # replaced (not written in place: this process maps it)
        for library in (tmp_path / "cpp").glob("*.so"):
            garbage = library.with_name("garbage")
            garbage.write_bytes(b"\0" * 64)
            os.replace(garbage, library)
    else:
        entry.write_bytes(data[:len(data) // 2] if damage == "truncated" else
                          data[:-20] + bytes(20))
    check(plait.jit(f, backend="cpp"))
    assert len(lowerings) == 2
    check(plait.jit(f, backend="cpp"))
    assert len(lowerings) == 2  # the replaced entry loads


def test_an_entry_copied_over_another_key_is_compiled_again(lowerings, tmp_path):
    check(plait.jit(f, backend="cpp"))
    (f_entry,) = _entries(tmp_path)
    check(plait.jit(g, backend="cpp"), g)
    (g_entry,) = set(_entries(tmp_path)) - {f_entry}
    shutil.copyfile(f_entry, g_entry)  # f's program under g's key
    check(plait.jit(g, backend="cpp"), g)  # not f's results: compiled again
    assert len(lowerings) == 3
    check(plait.jit(g, backend="cpp"), g)
    assert len(lowerings) == 3  # and replaced


class _Planted:
    """Unpickled, it creates the file ``marker``: what a planted entry could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant(tmp_path):
    """f's entry replaced by a planted one with a valid header; the file it would create."""
    check(plait.jit(f, backend="cpp"))
    (entry,) = _entries(tmp_path)
    marker = tmp_path / "ran"
    _with_payload(entry, pickle.dumps(_Planted(marker)))
    return entry, marker


def test_a_planted_entry_is_what_the_folder_holds(lowerings, tmp_path):
    """The user's own folder is trusted (NOTE [unpickling the cache]): the planted entry of
    the tests below runs there, so that it does not run there is the folder's check."""
    entry, marker = _plant(tmp_path)
    program_cache.load(entry.stem)
    assert marker.exists()


@pytest.mark.parametrize("unsafe", ["folder writable by others", "entry writable by others",
                                    "folder of another user"])
def test_a_cache_others_could_write_is_not_read(lowerings, tmp_path, monkeypatch, unsafe):
    entry, marker = _plant(tmp_path)
    monkeypatch.setattr(codegen, "_verdicts", {})  # as in a new process
    if unsafe == "folder writable by others":
        os.chmod(tmp_path / "programs", 0o777)
    elif unsafe == "entry writable by others":
        os.chmod(entry, 0o666)
    else:
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    if unsafe.startswith("folder"):
        with pytest.warns(UserWarning, match="does not use its compilation cache"):
            check(plait.jit(f, backend="cpp"))
    else:
        check(plait.jit(f, backend="cpp"))
    assert not marker.exists()
    assert len(lowerings) == 2
    if unsafe == "entry writable by others":  # replaced by a private one, which loads
        assert not entry.stat().st_mode & 0o077
        check(plait.jit(f, backend="cpp"))
        assert len(lowerings) == 2


def test_folders_and_entries_are_private(lowerings, tmp_path):
    check(plait.jit(f, backend="cpp"))
    for kind in ("programs", "cpp"):
        assert (tmp_path / kind).stat().st_mode & 0o777 == 0o700
    (entry,) = _entries(tmp_path)
    assert entry.stat().st_mode & 0o777 == 0o600


def test_the_least_recently_used_entries_go_past_the_size_limit(tmp_path):
    with plait.config.patch(cache_dir=str(tmp_path)):
        for name in "abc":
            program_cache.store(name, torch.full((256,), ord(name)))  # about 1.5 KB each
        size = (tmp_path / "programs" / "a.pkl").stat().st_size
        for age, name in enumerate("cba"):  # a is the oldest, then b, then c
            os.utime(tmp_path / "programs" / f"{name}.pkl", (time.time() - 100 * (age + 1),) * 2)
        assert program_cache.load("a")[0] == ord("a")  # used now: the newest
        with plait.config.patch(program_cache_bytes=3 * size):
            program_cache.store("d", torch.full((256,), ord("d")))
        assert sorted(p.stem for p in _entries(tmp_path)) == ["a", "c", "d"]
        assert sum(p.stat().st_size for p in _entries(tmp_path)) <= 3 * size


def test_the_least_recently_used_libraries_go_past_the_size_limit(tmp_path):
    """The C++ build cache is bounded too: a library with its source and checksum goes as
    one, the least recently loaded first, never the one just built."""
    source = "extern \"C\" int answer_{0}() {{ return {0}; }}\n"
    with plait.config.patch(cache_dir=str(tmp_path)):
        for k in range(3):
            cpp.build(source.format(k), [f"answer_{k}"])
        libraries = sorted((tmp_path / "cpp").glob("*.so"), key=lambda p: p.stat().st_mtime)
        for age, path in enumerate(reversed(libraries)):  # the first built is the oldest
            os.utime(path, (time.time() - 100 * (age + 1),) * 2)
        assert cpp.build(source.format(0), ["answer_0"], only_cached=True) is not None  # used
        entry = sum(p.stat().st_size for p in (tmp_path / "cpp").iterdir()) / 3
        with plait.config.patch(cpp_cache_bytes=int(3.5 * entry)):
            cpp.build(source.format(3), ["answer_3"])
        left = {p.name.split(".")[0] for p in (tmp_path / "cpp").iterdir()}
        assert len(left) == 3 and len(list((tmp_path / "cpp").iterdir())) == 9
        assert cpp.build(source.format(1), ["answer_1"], only_cached=True) is None  # it went
        for k in (0, 2, 3):
            assert cpp.build(source.format(k), [f"answer_{k}"], only_cached=True) is not None


def test_builds_a_killed_process_left_are_removed(tmp_path, monkeypatch):
    stale = [tmp_path / "cpp" / "plait-build", tmp_path / "programs" / "plait-x.pkl"]
    fresh = tmp_path / "cpp" / "plait-building-now"
    for path in [*stale, fresh]:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        path.mkdir() if path.suffix != ".pkl" else path.write_bytes(b"half")
    for path in stale:
        os.utime(path, (time.time() - 2 * codegen._STALE,) * 2)
    monkeypatch.setattr(codegen, "_verdicts", {})  # as in a new process
    with plait.config.patch(cache_dir=str(tmp_path)):
        codegen.cache_folder("cpp"), codegen.cache_folder("programs")
    assert not any(path.exists() for path in stale)
    assert fresh.exists()  # a build in progress


def test_the_cache_can_be_turned_off(lowerings, tmp_path):
    with plait.config.patch(program_cache=False):
        check(plait.jit(f, backend="cpp"))
        check(plait.jit(f, backend="cpp"))
    assert len(lowerings) == 2
    assert not (tmp_path / "programs").exists()


def test_inspection_after_a_hit_compiles_under_the_settings_of_lower(lowerings):
    with plait.config.patch(simplify=False):
        check(plait.jit(f, backend="cpp"))
        lowered = plait.jit(f, backend="cpp").lower(*inputs())
        lowered.runner  # a hit: nothing compiled
    assert len(lowerings) == 1
    assert lowered.graph == lowered.source_graph  # simplified after the patch: still not
    assert lowered.stats["kernels"] >= 1
    assert len(lowerings) == 2


def test_what_does_not_pickle_is_not_kept(tmp_path):
    with plait.config.patch(cache_dir=str(tmp_path)):
        program_cache.store("closure", lambda inputs: inputs)
        assert program_cache.load("closure") is None
        assert not os.listdir(tmp_path / "programs")


def test_aten_ops_are_kept_by_name(tmp_path):
    with plait.config.patch(cache_dir=str(tmp_path)):
        program_cache.store("op", {"op": torch.ops.aten.add.Tensor})
        assert program_cache.load("op")["op"] is torch.ops.aten.add.Tensor


def test_a_program_that_cannot_be_written_still_runs(lowerings, monkeypatch, caplog):
    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(program_cache, "write_atomically", disk_full)
    check(plait.jit(f, backend="cpp"))
    assert "could not keep" in caplog.text
