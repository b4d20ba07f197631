"""Model state in tiers: budgets, copies below, dedupe, crash-safe disk, bit-exact restores."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from asyncio.subprocess import PIPE
from pathlib import Path

import pytest
import torch

from services.gpu_manager import examples
from services.gpu_manager.state.disk import DiskStore
from services.gpu_manager.state.keys import key_of, raw_bytes
from services.gpu_manager.state.manager import MB, StateConfig, StateManager
from services.gpu_manager.state.tiers import Tier, TierFull, Tiers

from ..support import eventually

KB = 1024
REPO = Path(__file__).resolve().parents[2]


def _mlp(seed: int, head_seed: int | None = None) -> torch.nn.Module:
    """A base MLP; with ``head_seed``, a fine-tune of it whose last layer alone differs."""
    torch.manual_seed(seed)
    model = examples.mlp()
    if head_seed is not None:
        torch.manual_seed(head_seed)
        last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
        with torch.no_grad():
            last.weight.add_(torch.randn_like(last.weight))
    return model


def _linear(seed: int) -> torch.nn.Module:
    """A model no tensor of which equals another seed's (16.6 KB)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 56))


def _out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def _manager(tmp_path: Path, host_kb: int = 0, disk: bool = True) -> StateManager:
    cfg = StateConfig(disk_dir=str(tmp_path / "store") if disk else "", pin=False)
    mgr = StateManager(cfg)
    mgr.tiers.host.budget = host_kb * KB  # below a MB: the test models are small
    mgr.start()
    return mgr


# ---------------------------------------------------------------------- the pure core


def test_tiers_random_walk_keeps_every_invariant() -> None:
    """Random services over shared keys, random promotions, pins and forgets: no tier ever
    exceeds its budget, every host key has a copy on disk, pinned keys are never evicted."""
    rng = random.Random(7)
    keys = {f"{i:040x}": rng.randrange(1, 50) for i in range(30)}
    tiers = Tiers(Tier(200), Tier(900))
    pinned: dict[str, frozenset[str]] = {}
    for step in range(2000):
        service = f"s{rng.randrange(8)}"
        op = rng.random()
        if op < 0.3:
            chosen = rng.sample(sorted(keys), rng.randrange(1, 5))
            tiers.forget(service)
            tiers.reference(service, {k: keys[k] for k in chosen})
            try:
                for k in tiers.admit_disk(chosen):
                    assert k not in tiers.referenced()
                for k in chosen:
                    tiers.on_disk(k)
            except TierFull:
                tiers.forget(service)
        elif op < 0.7 and service in tiers.refs:
            before = set(tiers.host.keys)
            held = {k for ks in pinned.values() for k in ks}
            try:
                plan = tiers.promote(service)
            except TierFull:
                assert set(tiers.host.keys) == before
            else:
                assert not set(plan.evict) & held, "a pinned key was evicted"
                assert not tiers.missing_host(service)
        elif op < 0.85 and service in tiers.refs and service not in pinned:
            pinned[service] = tiers.pin(service)
        elif service in pinned:
            tiers.unpin(pinned.pop(service))
        assert not tiers.violations(), (step, tiers.violations())


def test_host_without_disk_refuses_rather_than_exceeds() -> None:
    tiers = Tiers(Tier(100), None)
    tiers.reference("a", {"a" * 40: 60})
    tiers.promote("a")
    tiers.reference("b", {"b" * 40: 60})
    with pytest.raises(TierFull, match="host tier full"):
        tiers.promote("b")
    assert tiers.host.used == 60
    assert not tiers.violations()


# ---------------------------------------------------------------------- keys and dedupe


def test_a_changed_tensor_never_aliases_the_old_one() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    k = key_of(raw_bytes(t))
    assert key_of(raw_bytes(t.clone())) == k
    t2 = t.clone()
    t2[500] = torch.nextafter(t2[500], torch.tensor(1e9))  # one ulp
    assert key_of(raw_bytes(t2)) != k


def test_fine_tunes_share_their_base_once(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    x = torch.randn(4, 8)
    refs, copies = {}, {}
    for name, model in [("base", _mlp(0)), *[(f"ft{i}", _mlp(0, i)) for i in (1, 2, 3)]]:
        refs[name] = _out(model, x)
        copies[name] = mgr.capture(name, model)
    report = mgr.report()
    head = {k for k in copies["ft1"].keys if k not in copies["base"].keys}
    assert len(head) == 1, "only the head changed"
    assert report.stored_bytes < report.logical_bytes / 2
    files = sorted(p.name for p in (tmp_path / "store").iterdir())
    assert len(files) == len(set(copies["base"].keys)) + 3
    for name, copy in copies.items():  # each restores to its own outputs, no aliasing
        held = mgr.acquire(name)
        assert torch.equal(_out(copy.restore("cpu").model, x), refs[name])
        mgr.release(held)
    assert not torch.equal(refs["ft1"], refs["base"])
    assert not mgr.violations()


# ---------------------------------------------------------------------- disk -> host -> device


def test_restore_from_disk_is_bit_exact_and_budgets_hold(tmp_path: Path) -> None:
    """Host memory holds one service: the others are evicted to disk and promoted back."""
    models = {f"m{i}": _linear(i) for i in range(3)}
    size = sum(p.numel() * 4 for p in models["m0"].parameters())
    mgr = _manager(tmp_path, host_kb=-(-size * 3 // 2 // KB))
    x = torch.randn(3, 8)
    refs = {n: _out(m, x) for n, m in models.items()}
    copies = {n: mgr.capture(n, m) for n, m in models.items()}
    assert not mgr.in_host("m0"), "evicted: the host tier holds about one service"
    for name in ["m0", "m2", "m1", "m0"]:
        held = mgr.acquire(name)
        assert mgr.in_host(name)
        assert torch.equal(_out(copies[name].restore("cpu").model, x), refs[name])
        mgr.release(held)
        assert not mgr.violations()
        assert mgr.report().host_bytes <= mgr.tiers.host.budget
    assert mgr.report().promotions >= 3


def test_a_pinned_service_is_never_evicted(tmp_path: Path) -> None:
    models = {f"m{i}": _linear(i) for i in range(2)}
    size = sum(p.numel() * 4 for p in models["m0"].parameters())
    mgr = _manager(tmp_path, host_kb=-(-size * 3 // 2 // KB))
    for n, m in models.items():
        mgr.capture(n, m)
    held = mgr.acquire("m0")  # a restore is reading m0
    assert not mgr.prefetch("m1"), "m1 fits only by evicting m0"
    assert mgr.in_host("m0")
    mgr.release(held)
    assert not mgr.prefetch("m1", keep=["m0"]), "m0 has calls queued: a hint keeps it"
    assert mgr.in_host("m0")
    assert mgr.prefetch("m1")
    assert not mgr.in_host("m0")


def test_larger_than_the_host_tier_is_refused(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, host_kb=1)
    with pytest.raises(TierFull, match="more than the whole host tier"):
        mgr.capture("big", _mlp(0))
    assert not mgr.violations()
    assert "big" not in mgr.tiers.refs


def test_restart_finds_the_store_and_writes_nothing_again(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    mgr.capture("a", _mlp(0))
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "store").iterdir()}
    again = StateManager(StateConfig(disk_dir=str(tmp_path / "store"), pin=False))
    assert again.start() == len(stamps)
    copy = again.capture("a", _mlp(0))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "store").iterdir()} == stamps
    assert again.in_host("a")
    assert len(set(copy.keys)) == len(stamps)


# ---------------------------------------------------------------------- crash safety

WRITER = """
import sys
from services.gpu_manager.state.disk import DiskStore
assert "torch" not in sys.modules  # starts fast
store = DiskStore(sys.argv[1], drop_cache=False)
data = memoryview(bytearray(int(sys.argv[2])))
print("ready", flush=True)
i = 0
while True:
    store.write(f"{i:040x}", data)
    i += 1
"""


async def test_kill_9_during_writes_leaves_a_usable_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = DiskStore(root)
    good = torch.arange(256, dtype=torch.uint8)
    store.write(key_of(good), good)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, str(root), str(64 * MB), stdout=PIPE, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        assert (await proc.stdout.readline()).strip() == b"ready"
        mid_write = lambda: any(".tmp" in p.name for p in root.iterdir())  # noqa: E731
        await eventually(mid_write, what="the writer mid-file", interval_s=0.001)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
    assert any(".tmp" in p.name for p in root.iterdir())
    (root / f"{'f' * 40}.safetensors").write_bytes(b"\x10\x00\x00")  # a torn file, too
    found = store.scan(verify=True)
    assert key_of(good) in found
    assert not any(".tmp" in p.name for p in root.iterdir())
    assert "f" * 40 not in found
    for key, n in found.items():  # whatever survived is whole
        assert key == key_of(good) or n == 64 * MB
    assert torch.equal(store.read(key_of(good), 256), good)


def test_store_files_are_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    store = DiskStore(tmp_path)
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    store.write(key_of(data), data)
    assert torch.equal(load_file(str(store.path(key_of(data))))["data"], data)
