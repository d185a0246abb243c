"""Python-callable rewards used by the tests (reward.type: callable)."""


def vowels(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(sum(ch in "aeiou" for ch in r)) for r in responses]


def nan_on_poison(prompts: list[str], responses: list[str]) -> list[float]:
    """A broken reward: NaN for every response to a prompt that mentions poison."""
    return [float("nan") if "poison" in p else 1.0 for p in prompts]


def raises(prompts: list[str], responses: list[str]) -> list[float]:
    """A reward with a bug: ValueError for a prompt that mentions poison."""
    if any("poison" in p for p in prompts):
        raise ValueError("cannot score poison")
    return vowels(prompts, responses)


def slow_vowels(prompts: list[str], responses: list[str]) -> list[float]:
    """vowels, a quarter of a second a call: a run's shards then take a share of its life
    that a signal at a random point can land in (tests/test_signal_property.py)."""
    import time

    time.sleep(0.25)
    return vowels(prompts, responses)
