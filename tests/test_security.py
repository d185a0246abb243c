"""Security basics (docs/security.md): nothing reaches a shell, trust_remote_code is opt-in."""

from __future__ import annotations

import ast
from pathlib import Path

import transformers

from specrej_ray.local import load_local
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_jsonl
from tests.tiny import save_tiny_classifier

PACKAGE = Path(__file__).resolve().parents[1] / "specrej_ray"
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("os", "spawnlp"), ("pty", "spawn")}


def shell_uses(source: str) -> list[str]:
    """Calls that hand a string to a shell: os.system / os.popen / ..., or any call with a
    `shell=` keyword that is not the constant False."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and (f.value.id, f.attr) in SHELL_CALLS):
            found.append(f"{f.value.id}.{f.attr} (line {node.lineno})")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                          and kw.value.value is False):
                found.append(f"shell= (line {node.lineno})")
    return found


def test_the_checker_sees_shell_calls():
    code = "import os, subprocess\nos.system('ls')\nsubprocess.run('ls', shell=True)\n"
    assert shell_uses(code) == ["os.system (line 2)", "shell= (line 3)"]
    assert shell_uses("subprocess.run(['ls'], shell=False)\n") == []


def test_no_shell_anywhere_in_the_package():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = {str(f.relative_to(PACKAGE)): shell_uses(f.read_text()) for f in files}
    assert {f: uses for f, uses in found.items() if uses} == {}


def _spec(tmp_path: Path, lm: Path, rm: Path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hi."}])
    rewards = [{"type": "classifier", "model": str(rm), "threads": 1},
               {"type": "lm_likelihood", "model": str(lm), "threads": 1, "name": "lm"}]
    return validate_spec(tiny_job(tmp_path, lm, prompts, reward=rewards))


def test_trust_remote_code_is_false_unless_asked(tmp_path, tiny_lm_dir):
    spec = _spec(tmp_path, tiny_lm_dir, tmp_path / "rm")

    def flags(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from [value] if key == "trust_remote_code" else flags(value)
        elif isinstance(node, list):
            for item in node:
                yield from flags(item)

    assert list(flags(spec.model_dump())) == [False, False, False]  # generator, 2 rewards


def test_models_load_without_remote_code(tmp_path, tiny_lm_dir, monkeypatch):
    """Every from_pretrained that load_local (the same loaders as the actors) makes is told
    trust_remote_code=False."""
    rm = save_tiny_classifier(tmp_path / "rm")
    spec = _spec(tmp_path, tiny_lm_dir, rm)
    calls: list[tuple[str, object]] = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer,
                transformers.AutoModelForCausalLM,
                transformers.AutoModelForSequenceClassification):
        original = cls.from_pretrained

        def spy(*args, _original=original, _name=cls.__name__, **kwargs):
            calls.append((_name, kwargs.get("trust_remote_code", "absent")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    job = load_local(spec)
    assert len(job.rewards) == 2 and job.tasks
    loaded = {name for name, _ in calls}
    assert {"AutoTokenizer", "AutoModelForCausalLM",
            "AutoModelForSequenceClassification"} <= loaded
    assert [c for c in calls if c[1] is not False] == []

