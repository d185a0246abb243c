"""CandidateSampler driven directly, with fabricated vLLM batch updates (no engine): each
candidate row draws sample_next(its logits, its settings, candidate_uniforms(seed, pkey,
index, step)) with step = prompt_len - offset + len(its live output list), through adds,
removals, condensing moves, swaps, chunked prefills, preemption and growth; rows without
our extra args are left alone; and apply does no host work (issue 30)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next

if TYPE_CHECKING:
    from vllm.v1.sample.logits_processor import BatchUpdate

    from specrej_ray.engine.vllm.candidate_sampler import CandidateSampler

VOCAB = 64
# vLLM's side (our sampler, its batch updates), filled when this module's tests start: every
# pytest worker collects the module but only one runs it, and importing vLLM costs a second.
V = SimpleNamespace()


@pytest.fixture(autouse=True, scope="module")
def _vllm_side():
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from specrej_ray.engine.vllm import candidate_sampler

    V.cs, V.BatchUpdate = candidate_sampler, BatchUpdate
    V.SWAP, V.MOVE = MoveDirectionality.SWAP, MoveDirectionality.UNIDIRECTIONAL


def sampler(max_num_seqs: int = 8, device: str = "cpu") -> CandidateSampler:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))
    return V.cs.CandidateSampler(config, torch.device(device), False)


@dataclass
class Req:
    """A request as vLLM's worker holds it: prompt, live output list, prefill steps left
    (the last prefill chunk keeps its token), its extra args (None: not a candidate)."""
    prompt: list[int]
    args: dict | None
    output: list[int] = field(default_factory=list)
    prefill: int = 1

    def added(self, row: int) -> tuple:
        params = SimpleNamespace(extra_args=None if self.args is None else dict(self.args))
        return (row, params, self.prompt, self.output)


def cand(seed=7, pkey=11, index=0, offset=0, prompt=5, prefill=1, t=1.0, p=1.0, k=0) -> Req:
    args = V.cs.draw_args(seed, pkey, index, offset, SamplingParams(t, p, k))
    return Req(list(range(prompt)), args, prefill=prefill)


def expected(req: Req, row_logits: torch.Tensor) -> int:
    a = req.args[V.cs.KEY]
    step = len(req.prompt) - a["offset"] + len(req.output)
    u = candidate_uniforms(a["seed"], torch.tensor([a["pkey"]]), torch.tensor([a["index"]]),
                           torch.tensor([step]))
    params = SamplingParams(a["temperature"], a["top_p"], a["top_k"])
    return int(sample_next(row_logits.unsqueeze(0), params, u)[0])


def step(proc: CandidateSampler, batch: list[Req], update: BatchUpdate | None,
         gen: torch.Generator) -> None:
    """One engine step: update_state, apply on fresh logits, each row checked against the
    reference draw; then vLLM's bookkeeping (a prefill chunk's token is dropped)."""
    proc.update_state(update)
    logits = torch.randn(len(batch), VOCAB, generator=gen)  # flat: a wrong step shows
    before = logits.clone()
    out = proc.apply(logits)
    for row, req in enumerate(batch):
        if V.cs.KEY not in (req.args or {}):
            assert torch.equal(out[row], before[row]), f"row {row} is not ours"
            token = int(before[row].argmax())
        else:
            token = expected(req, before[row])
            finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
            assert finite == [token] and out[row, token] == 0.0, f"row {row}"
        if req.prefill > 1:
            req.prefill -= 1  # a prefill chunk: apply ran, its token is discarded
        else:
            req.prefill = 0
            req.output.append(token)


def update(batch: list[Req], removed=(), added=(), moved=()) -> BatchUpdate:
    return V.BatchUpdate(len(batch), list(removed), [batch[i].added(i) for i in added],
                       list(moved))


def test_rows_draw_their_stream_as_outputs_grow():
    proc, gen = sampler(), torch.Generator().manual_seed(0)
    batch = [cand(index=0), cand(index=1, offset=3, prompt=9), cand(index=2, pkey=5)]
    step(proc, batch, update(batch, added=range(3)), gen)
    for _ in range(6):  # no batch change: only the live lists grow
        step(proc, batch, None, gen)
    assert [len(r.output) for r in batch] == [7, 7, 7]


def test_a_chunked_prefill_counts_from_its_first_token():
    proc, gen = sampler(), torch.Generator().manual_seed(1)
    batch = [cand(index=0), cand(index=1, prefill=4), cand(index=2, prefill=2)]
    step(proc, batch, update(batch, added=range(3)), gen)
    for _ in range(8):
        step(proc, batch, None, gen)
    assert [len(r.output) for r in batch] == [9, 6, 8]


def test_foreign_rows_and_mixed_settings():
    proc, gen = sampler(), torch.Generator().manual_seed(2)
    batch = [cand(index=0), Req([1, 2, 3], None), cand(index=1, t=0.7, k=5),
             cand(seed=9, index=2, t=0.0), Req([4], {"other": 1}), cand(index=3, p=0.8)]
    step(proc, batch, update(batch, added=range(len(batch))), gen)
    for _ in range(4):
        step(proc, batch, None, gen)


def test_removals_condense_swaps_and_replacements():
    proc, gen = sampler(), torch.Generator().manual_seed(3)
    batch = [cand(index=i, prefill=1 + i % 2) for i in range(5)]
    step(proc, batch, update(batch, added=range(5)), gen)
    step(proc, batch, None, gen)
    step(proc, batch, None, gen)
    # rows 1 and 3 finish; a new request takes the lowest hole (1: vLLM pops it from the
    # removed list), the last row condenses into the other (4 -> 3), and the attention
    # backend swaps 0 and 2
    batch[1], batch[3] = cand(index=9, prompt=2, prefill=3), batch[4]
    del batch[4]
    adds = [batch[1].added(1)]
    batch[0], batch[2] = batch[2], batch[0]
    step(proc, batch, V.BatchUpdate(4, [3], adds, [(4, 3, V.MOVE), (0, 2, V.SWAP)]), gen)
    for _ in range(4):
        step(proc, batch, None, gen)
    # a row replaced in place by a request that is not ours, and one by a candidate
    batch[0], batch[1] = Req([1], None), cand(index=12, offset=1)
    step(proc, batch, update(batch, added=[0, 1]), gen)
    step(proc, batch, None, gen)


def test_preempted_candidate_resumes_its_stream():
    proc, gen = sampler(), torch.Generator().manual_seed(4)
    batch = [cand(index=0), cand(index=1)]
    step(proc, batch, update(batch, added=range(2)), gen)
    for _ in range(3):
        step(proc, batch, None, gen)
    out = batch.pop(0)  # preempted: removed, its output list kept; the other moves up
    step(proc, batch, update(batch, removed=[0], moved=[(1, 0, V.MOVE)]), gen)
    step(proc, batch, None, gen)
    out.prefill = 2  # resumed: re-prefills prompt + outputs (two chunks), same list
    batch.append(out)
    step(proc, batch, update(batch, added=[1]), gen)
    for _ in range(6):
        step(proc, batch, None, gen)
    assert len(out.output) == 4 + 6  # one chunk dropped, then a token a step


def test_more_rows_than_max_num_seqs():
    proc, gen = sampler(max_num_seqs=2), torch.Generator().manual_seed(5)
    batch = [cand(index=i) for i in range(2)]
    step(proc, batch, update(batch, added=range(2)), gen)
    batch += [cand(index=i) for i in range(2, 7)]
    step(proc, batch, update(batch, added=range(2, 7)), gen)
    step(proc, batch, None, gen)


@pytest.mark.parametrize("mixed", [False, True])
def test_random_schedules(mixed):
    """vLLM-like churn: adds into holes or the end, removals and condensing, swaps,
    preemptions, chunked prefills; every draw checked."""
    rnd, gen = random.Random(6 + mixed), torch.Generator().manual_seed(6)
    proc = sampler(max_num_seqs=4)
    batch: list[Req] = []
    parked: list[Req] = []
    settings = [dict(), dict(t=0.5, k=4), dict(seed=3, t=0.0)] if mixed else [dict()]
    made = 0
    for _ in range(60):
        removed, added, moved = [], [], []
        for i in sorted(rnd.sample(range(len(batch)), k=min(len(batch), rnd.randint(0, 2)))):
            removed.append(i)
            if rnd.random() < 0.5:
                batch[i].prefill = rnd.randint(1, 3)
                parked.append(batch[i])  # preempted: comes back later, same output list
        holes = sorted(removed)
        news = []
        for _ in range(rnd.randint(0, 3)):
            if parked and rnd.random() < 0.5:
                news.append(parked.pop(0))
            elif rnd.random() < 0.15:
                news.append(Req([1, 2], None))
            else:
                made += 1
                news.append(cand(index=made, pkey=made % 3, offset=rnd.randint(0, 2),
                                 prompt=rnd.randint(2, 6), prefill=rnd.randint(1, 3),
                                 **rnd.choice(settings)))
        rows: list[Req | None] = list(batch)
        for i in holes:
            rows[i] = None
        for req in news:  # the lowest hole first, else the end (gpu_input_batch)
            if holes:
                i = holes.pop(0)
                removed.remove(i)  # vLLM pops a reused hole from the removed list
                rows[i] = req
            else:
                i = len(rows)
                rows.append(req)
            added.append(i)
        while holes:  # condense: the last request fills the lowest hole
            hole = holes.pop(0)
            while rows and rows[-1] is None:
                rows.pop()
            if hole >= len(rows):
                break
            rows[hole] = rows.pop()
            moved.append((len(rows), hole, V.MOVE))
        batch = [r for r in rows if r is not None]
        assert len(batch) == len(rows)
        adds = [batch[i].added(i) for i in added]  # where they were added, before moves
        if len(batch) > 1 and rnd.random() < 0.3:
            a, b = rnd.sample(range(len(batch)), 2)
            batch[a], batch[b] = batch[b], batch[a]
            moved.append((a, b, V.SWAP))
        changed = removed or added or moved
        up = V.BatchUpdate(len(batch), removed, adds, moved)
        if batch:
            step(proc, batch, up if changed else None, gen)
        else:
            proc.update_state(up if changed else None)
    assert made > 20


class Ops(TorchDispatchMode):
    """The aten operations run, with whether any touched a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.on_cpu: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops.append(name)
        flat = [*torch.utils._pytree.tree_leaves((args, kwargs or {})),
                *torch.utils._pytree.tree_leaves(out)]
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in flat):
            self.on_cpu.append(name)
        return out


SYNCS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero",
         "aten.masked_select", "aten.equal"}
VIEWS = {"aten.slice", "aten.select", "aten.view", "aten.alias", "aten.unsqueeze",
         "aten.squeeze", "aten.expand", "aten.detach", "aten._unsafe_view", "aten.as_strided"}


@pytest.mark.parametrize("mixed", [False, True])
def test_apply_is_device_work_only(mixed):
    """On the meta device any read of a value (item, tolist, nonzero, a bool mask) raises,
    and a host tensor entering apply (torch.tensor of a list, an upload) shows as an op on a
    CPU tensor: apply must have neither, whatever the batch did before."""
    proc = sampler(max_num_seqs=4, device="meta")
    batch = [cand(index=i, prefill=1 + i % 2, **(dict(t=0.5, k=3) if mixed and i % 2 else {}))
             for i in range(6)] + [Req([1], None)]
    proc.update_state(update(batch, added=range(len(batch))))
    for n in range(3):
        if n == 2:
            proc.update_state(update(batch, moved=[(0, 3, V.SWAP)]))
        else:
            proc.update_state(None)
        for req in batch:
            req.output.append(1)
        logits = torch.empty(len(batch), VOCAB, device="meta")
        with Ops() as ops:
            proc.apply(logits)
        assert ops.ops and not SYNCS & set(ops.ops), ops.ops
        assert not ops.on_cpu, ops.on_cpu


def test_one_setting_is_one_vectorized_draw():
    """All rows ours with one setting: the draw runs on the logits, no gather per row or
    per group; a foreign row, or a second setting, brings in one gather per setting, and
    its removal takes it away again."""
    def ops_of(proc: CandidateSampler, rows: int) -> list[str]:
        with Ops() as ops:
            proc.apply(torch.empty(rows, VOCAB, device="meta"))
        return [op for op in ops.ops if op not in VIEWS]  # views launch nothing

    def started(batch: list[Req]) -> CandidateSampler:
        proc = sampler(device="meta")
        proc.update_state(update(batch, added=range(len(batch))))
        return proc

    ours = ops_of(started([cand(index=i) for i in range(6)]), 6)
    assert "aten.index_select" not in ours and "aten.index" not in ours
    assert ours == ops_of(started([cand(index=i) for i in range(60)]), 60)  # no work per row
    for other in (Req([1], None), cand(index=5, t=0.5)):
        batch = [cand(index=i) for i in range(5)] + [other]
        proc = started(batch)
        gathers = ops_of(proc, 6).count("aten.index_select")
        assert gathers == 4 * (1 + (V.cs.KEY in (other.args or {})))  # logits, pkey, index, step
        proc.update_state(V.BatchUpdate(5, [5], [], []))  # the other row ends
        assert ops_of(proc, 5) == ours
