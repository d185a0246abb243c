"""Python-callable rewards used by the tests (reward.type: callable)."""


def vowels(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(sum(ch in "aeiou" for ch in r)) for r in responses]


def nan_on_poison(prompts: list[str], responses: list[str]) -> list[float]:
    """A broken reward: NaN for every response to a prompt that mentions poison."""
    return [float("nan") if "poison" in p else 1.0 for p in prompts]
