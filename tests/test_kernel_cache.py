"""The compiled kernel is loaded only from the per-user cache, only when its folder and files are this user's and
no one else can write them, and only when its bytes are those recorded at the build; the wrappers refuse
arguments that would make the C code read or write outside its buffers.

A "planted" library here is a shared object whose constructor creates a marker file: the marker appearing
would mean it was loaded (its code ran in this process)."""
from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from akv_core.kernels import cpu_gemv, native_cache

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason=f"cpu_gemv: {cpu_gemv.why_unavailable()}")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("AKV_PLANTED_MARKER");
    FILE *f = marker ? fopen(marker, "w") : NULL;
    if (f) fclose(f);
}
int akv_max_rows(void) { return 16; }
"""


def fresh_reason() -> str | None:
    """why_unavailable() as a new process would see it (the library is looked up again)."""
    cpu_gemv._loaded.cache_clear()
    return cpu_gemv.why_unavailable()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One build through the normal path into a fresh cache (folders above it missing too): the library."""
    folder = tmp_path_factory.mktemp("cache") / "a" / "b" / "kernels"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(native_cache.CACHE_ENV, str(folder))
        try:
            reason = fresh_reason()
            library = Path(cpu_gemv._library()._name) if reason is None else None
        finally:
            cpu_gemv._loaded.cache_clear()   # the next lookup follows the next test's environment
    assert reason is None, reason
    return library


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("planted") / "planted.c"
    source.write_text(PLANTED_C)
    library = source.with_suffix(".so")
    subprocess.run([cpu_gemv.compiler(), "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


@pytest.fixture
def place(monkeypatch, tmp_path) -> Iterator[dict[str, Path]]:
    """This test's cache folder, data folder and marker; the library looked up afresh before and after."""
    paths = {"cache": tmp_path / "kernels", "home": tmp_path / "home", "marker": tmp_path / "marker"}
    monkeypatch.setenv(native_cache.CACHE_ENV, str(paths["cache"]))
    monkeypatch.setenv("AKV_HOME", str(paths["home"]))
    monkeypatch.setenv("AKV_PLANTED_MARKER", str(paths["marker"]))
    cpu_gemv._loaded.cache_clear()
    yield paths
    cpu_gemv._loaded.cache_clear()   # the user's own cache again for the other tests


def name() -> str:
    return cpu_gemv.library_name(cpu_gemv.compiler())


def put(library: Path, folder: Path, recorded: bool = True) -> Path:
    """A copy of `library` under the name the loader looks for in `folder` (made 0700), recorded if asked."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = folder / f"{name()}.so"
    shutil.copyfile(library, target)
    target.chmod(0o700)
    if recorded:
        native_cache.record(target)
    return target


def nobody() -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' to give the file to")
    return entry.pw_uid, entry.pw_gid


Unsafe = Callable[[Path, Path], None]   # (cache folder, planted library) -> made unsafe
UNSAFE: dict[str, tuple[Unsafe, str]] = {
    "folder-group-writable": (lambda folder, lib: folder.chmod(0o770), "writable by group or others"),
    "folder-other-writable": (lambda folder, lib: folder.chmod(0o707), "writable by group or others"),
    "library-group-writable": (lambda folder, lib: lib.chmod(0o720), "writable by group or others"),
    "record-other-writable": (lambda folder, lib: native_cache.record_path(lib).chmod(0o602),
                              "writable by group or others"),
    "folder-above-writable": (lambda folder, lib: folder.parent.chmod(0o777), "above the kernel folder"),
    "library-a-symlink": (lambda folder, lib: (lib.rename(folder.parent / "elsewhere.so"),
                                               lib.symlink_to(folder.parent / "elsewhere.so")), "cannot be opened"),
    "folder-not-owned": (lambda folder, lib: os.chown(folder, *nobody()), "owned by uid"),
    "library-not-owned": (lambda folder, lib: os.chown(lib, *nobody()), "owned by uid"),
    "folder-above-not-owned": (lambda folder, lib: os.chown(folder.parent, *nobody()), "above the kernel folder"),
    "folder-above-writable-by-a-shared-group": (lambda folder, lib: (os.chown(folder.parent, 0, nobody()[1]),
                                                                     folder.parent.chmod(0o770)),
                                                "writable by group"),
}


@pytest.mark.parametrize("case", UNSAFE)
def test_a_library_in_an_unsafe_place_is_not_loaded_and_the_reason_is_given(place, planted, case):
    """Even with the right name and a record whose digest matches, a library that another user owns or could
    have written (or whose folder, or a folder above it, they could) is refused; torch's kernels stay."""
    make_unsafe, expected = UNSAFE[case]
    library = put(planted, place["cache"])
    make_unsafe(place["cache"], library)
    reason = fresh_reason()
    assert reason is not None and expected in reason and "not loaded" in reason, reason
    assert not place["marker"].exists() and not cpu_gemv.available()


def test_a_folder_above_may_be_writable_by_this_users_own_group_or_sticky(place, built):
    """A umask of 002 makes ~/.cache group-writable where each user has a private group: still safe, as is /tmp."""
    library = put(built, place["cache"])
    place["cache"].parent.chmod(0o1777)
    assert fresh_reason() is None
    if not native_cache._private_group(place["cache"].parent.stat().st_gid):
        pytest.skip("this user's group has other members")
    place["cache"].parent.chmod(0o770)
    assert fresh_reason() is None and Path(cpu_gemv._library()._name) == library.resolve()


def test_a_library_changed_after_its_build_is_refused_not_rebuilt(place, built, planted):
    """A digest differing from the record is reported, and the file is left as found (no silent rebuild)."""
    library = put(built, place["cache"])
    shutil.copyfile(native_cache.record_path(built), native_cache.record_path(library))
    changed = library.read_bytes() + b"\0"
    library.write_bytes(changed)   # still a loadable shared object
    reason = fresh_reason()
    assert reason is not None and "SHA-256" in reason and "not loaded" in reason, reason
    assert library.read_bytes() == changed
    shutil.copyfile(planted, library)   # another library under the recorded name: refused alike, never run
    assert "SHA-256" in (fresh_reason() or "") and not place["marker"].exists()


def test_a_library_without_a_record_is_rebuilt_and_recorded(place, planted):
    library = put(planted, place["cache"], recorded=False)
    assert fresh_reason() is None and not place["marker"].exists()
    recorded = json.loads(native_cache.record_path(library).read_text())["sha256"]
    rebuilt, old = (hashlib.sha256(path.read_bytes()).hexdigest() for path in (library, planted))
    assert recorded == rebuilt != old


def test_a_library_in_the_data_folder_is_never_loaded(place, built, planted, monkeypatch, tmp_path):
    """The data folder (AKV_HOME, by default `.akv/` in the working directory) held the libraries before: one
    planted there under the right name, and recorded, is not loaded, neither when nothing can be built nor
    when the cache holds a good library."""
    monkeypatch.chdir(tmp_path)
    for compiler in ("false", None):   # "false": a compiler that fails, so nothing is built
        if compiler:
            monkeypatch.setenv("CC", compiler)
        else:
            monkeypatch.delenv("CC", raising=False)
        for folder in (place["home"] / "kernels", tmp_path / ".akv" / "kernels"):
            put(planted, folder)
    monkeypatch.setenv("CC", "false")
    assert "could not be compiled" in (fresh_reason() or "") and not place["marker"].exists()
    monkeypatch.delenv("CC")
    put(built, place["cache"])
    assert fresh_reason() is None and not place["marker"].exists()
    assert Path(cpu_gemv._library()._name).parent == place["cache"].resolve()


def test_the_normal_path_builds_records_and_loads_a_private_library(built, place, monkeypatch):
    folder = built.parent
    for path in (folder, folder.parent, folder.parent.parent):   # made by the build, missing before it
        assert path.stat().st_mode & 0o777 == 0o700
    assert built.stat().st_mode & 0o077 == 0 and built.stat().st_uid == os.geteuid()
    record = json.loads(native_cache.record_path(built).read_text())
    assert record == {"file": built.name, "sha256": hashlib.sha256(built.read_bytes()).hexdigest()}
    monkeypatch.setenv(native_cache.CACHE_ENV, str(folder))
    stamp = built.stat().st_mtime_ns
    assert fresh_reason() is None and Path(cpu_gemv._library()._name) == built   # loaded again, not rebuilt
    assert built.stat().st_mtime_ns == stamp
    x, weight = torch.randn(2, 64), torch.randn(8, 64)
    assert torch.allclose(cpu_gemv.dense_gemv(x, weight), x @ weight.T, atol=1e-5)


def test_the_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(native_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_cache.cache_folder() == tmp_path / "xdg" / "akv" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")   # ignored, as the XDG specification says
    assert native_cache.cache_folder() == Path.home() / ".cache" / "akv" / "kernels"


# The wrappers: arguments that would send C outside its buffers raise ValueError naming them.

HEADS, KV_HEADS, D, SLOTS = 4, 2, 16, 10


def attention_args(rows: int = 2) -> dict:
    width = (HEADS + 2 * KV_HEADS) * D
    return {"qkv": torch.randn(rows, width), "heads": HEADS, "kv_heads": KV_HEADS, "cos": torch.ones(rows, D),
            "signed_sin": torch.zeros(rows, D), "k_pool": torch.zeros(SLOTS, KV_HEADS, D),
            "v_pool": torch.zeros(SLOTS, KV_HEADS, D), "out_slots": torch.tensor([8, 9]),
            "slots": torch.tensor([0, 1, 8, 2, 9]), "offsets": torch.tensor([0, 3, 5]), "scale": 0.25}


BAD_ATTENTION = {
    "out_slots": {"out_slots": torch.tensor([8, SLOTS])},
    "slots": {"slots": torch.tensor([0, 1, 8, 2, 10 ** 9])},
    "offsets": {"offsets": torch.tensor([0, 6, 5])},
    "heads": {"heads": 3},
    "kv_heads": {"kv_heads": 0},
    "qkv": {"heads": 2, "kv_heads": 1},
    "k_pool": {"k_pool": torch.zeros(SLOTS, 1, D)},
    "cos": {"cos": torch.ones(1, D)},
}


@pytest.mark.parametrize("argument", BAD_ATTENTION)
def test_decode_attention_refuses_arguments_outside_its_buffers(argument):
    args = attention_args()
    assert cpu_gemv.decode_attention(**args).shape == (2, HEADS * D)   # the good ones run
    args = {**attention_args(), **BAD_ATTENTION[argument]}
    pools = args["k_pool"].clone(), args["v_pool"].clone()
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        cpu_gemv.decode_attention(**args)
    assert torch.equal(args["k_pool"], pools[0]) and torch.equal(args["v_pool"], pools[1])   # nothing written


def small_stack(layers: int = 2, heads: int = HEADS) -> cpu_gemv.DecodeStack:
    hidden, inner = 64, 64

    def dense(n: int, k: int) -> cpu_gemv.Weights:
        return cpu_gemv.dense(torch.randn(n, k) * 0.05)

    made = [cpu_gemv.Layer(torch.ones(hidden), torch.ones(hidden), None, dense((heads + 2 * KV_HEADS) * D, hidden),
                           dense(hidden, heads * D), dense(2 * inner, hidden), dense(hidden, inner))
            for _ in range(layers)]
    return cpu_gemv.DecodeStack(made, HEADS, KV_HEADS, D, D, 1e-5)


def stack_args(layers: int = 2) -> dict:
    a = attention_args()
    return {"x": torch.randn(2, 64), "cos": a["cos"], "signed_sin": a["signed_sin"],
            "k_pools": [torch.zeros(SLOTS, KV_HEADS, D) for _ in range(layers)],
            "v_pools": [torch.zeros(SLOTS, KV_HEADS, D) for _ in range(layers)],
            "out_slots": a["out_slots"], "slots": a["slots"], "offsets": a["offsets"], "scale": 0.25}


BAD_STACK = {
    "out_slots": {"out_slots": torch.tensor([-1, 9])},
    "slots": {"slots": torch.tensor([0, 1, 8, 2, SLOTS])},
    "offsets": {"offsets": torch.tensor([0, 3, 4])},
    "k_pools": {"k_pools": [torch.zeros(SLOTS, KV_HEADS, D)]},
    "v_pools": {"v_pools": [torch.zeros(SLOTS, KV_HEADS + 1, D)] * 2},
    "x": {"x": torch.randn(2, 32)},
    "signed_sin": {"signed_sin": torch.zeros(2, D, dtype=torch.float64)},
}


@pytest.mark.parametrize("argument", BAD_STACK)
def test_the_decode_stack_refuses_arguments_outside_its_buffers(argument):
    stack = small_stack()
    stack(**stack_args())   # the good ones run
    args = {**stack_args(), **BAD_STACK[argument]}
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        stack(**args)
    assert all(not p.any() for p in args["k_pools"] + args["v_pools"])   # nothing written


def test_the_decode_stack_and_weights_refuse_wrong_head_counts_and_shapes():
    with pytest.raises(ValueError, match="heads"):
        small_stack(heads=6)   # the layers' qkv / o made for 6 heads, the stack told 4
    with pytest.raises(ValueError, match="kv_heads"):
        cpu_gemv.DecodeStack([], HEADS, 3, D, D, 1e-5)
    with pytest.raises(ValueError, match="head_dim"):
        cpu_gemv.DecodeStack([], HEADS, KV_HEADS, 12, 12, 1e-5)
    with pytest.raises(ValueError, match="rotary"):
        cpu_gemv.DecodeStack([], HEADS, KV_HEADS, D, D + 8, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        cpu_gemv.Weights(8, torch.zeros(8 * 32 - 1, dtype=torch.int8), torch.ones(8), None, 8, 32)
    with pytest.raises(ValueError, match="offset"):
        cpu_gemv.Weights(4, torch.zeros(8 * 16, dtype=torch.uint8), torch.ones(8), None, 8, 32)
    with pytest.raises(ValueError, match="norm"):
        cpu_gemv.gemv(torch.zeros(1, 64), cpu_gemv.dense(torch.zeros(8, 64)), cpu_gemv.Prologue(torch.ones(128)[::2]))
