"""A fixed set of varied prompts (prose, code, CJK, French, German, SQL, HTML, emoji) for
parity checks against reference implementations and for benchmarks."""

PROMPTS = (
    "The old lighthouse keeper climbed the stairs every evening, counting each step",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n",
    "东京是日本的首都，也是世界上人口最多的城市之一。",
    "La Révolution française a profondément transformé la société",
    "Photosynthesis converts light energy into chemical energy. In plants,",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING",
    "Wie spät ist es? Ich glaube, der Zug fährt um",
    "Here is a list of prime numbers: 2, 3, 5, 7, 11,",
    "<!DOCTYPE html>\n<html>\n  <head>\n    <title>",
    "Once upon a time 🐉 a dragon lived in",
)

CHAT = ({"role": "user", "content": "Write a haiku about the sea."},)
