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

# Code requests (chat-formatted by the caller): speculative decoding's held-out prompts for
# the code model, and the cross-vocabulary pair's (none of them is in any training set here).
CODE_TASKS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that returns the prime numbers below n.",
    "Write a Python function that reverses a linked list.",
    "Write a SQL query that returns the ten customers with the most orders.",
    "Write a JavaScript function that debounces another function.",
    "Write a Python function that parses a CSV line into fields.",
    "Write a Python function that computes the greatest common divisor of two integers.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that finds the longest common prefix of a list of strings.",
    "Write a Python function that performs binary search on a sorted list.",
    "Write a bash script that prints the ten largest files in a directory.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a C function that returns the length of a string.",
    "Write a Python function that computes the factorial of n iteratively.",
    "Write a Python function that groups a list of words by their first letter.",
)
