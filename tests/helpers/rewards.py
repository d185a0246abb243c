"""Python-callable rewards used by the tests (reward.type: callable)."""


def vowels(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(sum(ch in "aeiou" for ch in r)) for r in responses]
