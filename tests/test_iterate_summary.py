"""The loop's closing lines on its evaluations: columns under their headings."""

from __future__ import annotations

from specrej_ray.iterate.evaluation import summary_lines


def figures(instr: float, prompt: float) -> dict:
    return {"instruction_strict": {"value": instr}, "prompt_strict": {"value": prompt},
            "mean_tokens": {"value": 101.0}, "distinct_2": {"value": 0.5}}


def evaluation(label: str, sha: str, against: dict | None) -> dict:
    return {"prompts": 128, "label": label, "policy": {"sha256": sha},
            "figures": {"greedy": figures(0.412, 0.172), "sampled": figures(0.364, 0.156)},
            "against_base": against}


def test_each_figure_ends_under_its_heading():
    rise = {"instruction_strict": {"value": 0.099, "low": 0.043, "high": 0.156}}
    lines = summary_lines({"evaluations": [
        evaluation("round 0 (base)", "45f2397a3604", None),
        evaluation("round 2", "a2d7683975a4", {"greedy": rise, "sampled": rise})]})
    header, base, later = lines[2], lines[3], lines[4]

    def end(line: str, text: str, start: int = 0) -> int:
        return line.index(text, start) + len(text)

    assert "weights greedy: instr" in header  # headings apart, not run together
    assert end(header, "weights") == end(base, "45f2397") == end(later, "a2d7683")
    assert end(header, "greedy: instr") == end(base, "41.2") == end(later, "41.2")
    assert end(header, "sampled: instr") == end(base, "36.4") == end(later, "36.4")
    assert "+9.9 [+4.3, +15.6]" in later and summary_lines({}) == []
