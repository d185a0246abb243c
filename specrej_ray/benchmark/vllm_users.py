"""Best-of-N on vLLM as users run it today: one request per prompt with SamplingParams(n=N),
prefix caching on, vLLM's own sampling, then the same reward pass over the finished texts.

Its samples are vLLM's, not the candidate streams every other arm shares, so against the
vLLM Best-of-N arm it is an independent sample of the same N (the paper's eq. 5 setting).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specrej_ray.benchmark.arms import Arm, ArmRun, say
from specrej_ray.engine.decisions import Decisions
from specrej_ray.engine.task import EngineTask

USERS = "vllm-n"


def users_arm(n: int) -> Arm:
    return Arm(f"{USERS}{n}", n, 0.0)


def run_users_bon(engine, tasks: Sequence[EngineTask], n: int) -> ArmRun:
    """Every prompt as one n=N request, decoded together, then scored prompt by prompt."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from specrej_ray.engine.vllm.vllm_internals import token_prompt

    e = engine.best_of_n(n)
    st, llm, s = e.stats, e.llm, e.sampling
    params = SamplingParams(
        n=n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
        max_tokens=s.max_new_tokens, stop_token_ids=sorted(e.eos_ids),
        stop=list(s.stop) or None, detokenize=bool(s.stop),
        logprobs=0 if any(t.self_scored for t in tasks) and e.rewards.any_free else None,
        output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    states = {f"users-{t.prompt_id}": Decisions(e._config(None), t, n, None, 0, 0)
              for t in tasks}
    drawn: dict[str, list[tuple[list[int], list[float] | None]]] = {
        rid: [([], None) for _ in range(n)] for rid in states}
    seen: set[str] = set()
    for rid, d in states.items():
        llm.add_request(rid, token_prompt(d.input_ids), params)
        d.t0 = time.perf_counter()
        e.vllm.requests += 1
        e.vllm.prompt_tokens += len(d.input_ids)
    while llm.has_unfinished_requests():
        t_step = time.perf_counter()
        outputs = llm.step()
        seconds = time.perf_counter() - t_step
        rows = {}
        e.probe.count_preemptions()
        for out in outputs:
            if out.request_id not in seen:
                seen.add(out.request_id)
                e.vllm.cached_tokens += out.num_cached_tokens or 0
            rows[out.request_id] = _collect(drawn[out.request_id], out.outputs)
            if out.finished:
                _take(states[out.request_id], drawn[out.request_id])
        total = sum(rows.values())
        if total:
            for rid, k in rows.items():  # a prompt's share of the step: its rows'
                states[rid].engine_seconds += seconds * k / total
            st.decode_steps += 1
            st.row_steps += total
            e.vllm.step(e.probe.usage(), seconds)
            used = round(e.probe.usage() * e.probe.capacity_tokens)
            st.kv_token_steps += used
            st.alloc_token_steps += used
            st.budget_token_steps += e.probe.capacity_tokens
    results = []
    for d in states.values():
        d.send_final(n0=n, waves=1)  # the reward pass: the task's scorer, as every arm's
        d.apply_final(wait=True)
        results.append(d.result)
        st.prompts += 1
    seconds = time.perf_counter() - t0
    e.vllm.preemptions = e.probe.preemptions
    say(f"{USERS}{n}: {len(results)} prompts in {seconds:.1f} s")
    return ArmRun(users_arm(n), seconds, results, st, vllm=e.vllm.as_dict())


def _collect(drawn: list, completions) -> int:
    """Append a step's new tokens (and logprobs) per completion; the rows that drew one."""
    rows = 0
    for comp in completions:
        tokens, logprobs = drawn[comp.index]
        new = list(comp.token_ids)
        rows += bool(new)
        tokens += new
        if comp.logprobs is not None:
            drawn[comp.index] = (tokens, (logprobs or []) + [
                entry[t].logprob for entry, t in zip(comp.logprobs, new, strict=True)])
    return rows


def _take(d: Decisions, drawn: list) -> None:
    """The request's N completions as the prompt's candidates, finished."""
    for c, (tokens, logprobs) in zip(d.candidates, drawn, strict=True):
        for i, t in enumerate(tokens):
            if d.append(c, t, logprobs[i] if logprobs is not None else None):
                break
        if c.live:  # vLLM cut it at a stop string (it keeps the string out of the tokens)
            c.finish("stop", d.cfg.stopper.text(c.tokens))
