"""The built-in code problems: small classic functions, written for postrain.

Each problem: a signature, a description (the spec), a reference solution (used by the
demonstrations and by the test that checks every problem in the sandbox), visible tests (shown
to the model, which may run its code against them) and hidden tests (the reward). A test is a
Python comparison `call == expected`; `code.build_test_file` turns a list of them into a test file.
"""
from __future__ import annotations


def _p(signature, description, reference, visible, hidden):
    name = signature.split("(")[0].removeprefix("def ").strip()
    return {"name": name, "signature": signature, "description": description,
            "reference": reference.strip("\n") + "\n", "visible_tests": list(visible),
            "hidden_tests": list(hidden)}


PROBLEMS = [
    _p("def fizzbuzz(n: int) -> str",
       "Return 'FizzBuzz' if n is divisible by 3 and 5, 'Fizz' if by 3 only, 'Buzz' if by 5 only, "
       "else str(n).", '''
def fizzbuzz(n):
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
''', ["fizzbuzz(3) == 'Fizz'", "fizzbuzz(10) == 'Buzz'", "fizzbuzz(7) == '7'"],
       ["fizzbuzz(15) == 'FizzBuzz'", "fizzbuzz(1) == '1'", "fizzbuzz(9) == 'Fizz'",
        "fizzbuzz(25) == 'Buzz'", "fizzbuzz(45) == 'FizzBuzz'"]),
    _p("def fizzbuzz_list(n: int) -> list",
       "Return the FizzBuzz strings for 1..n in order ('Fizz' for multiples of 3, 'Buzz' of 5, "
       "'FizzBuzz' of both, else the number as a string).", '''
def fizzbuzz_list(n):
    out = []
    for i in range(1, n + 1):
        out.append("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else str(i))
    return out
''', ["fizzbuzz_list(3) == ['1', '2', 'Fizz']", "fizzbuzz_list(0) == []"],
       ["fizzbuzz_list(5) == ['1', '2', 'Fizz', '4', 'Buzz']", "len(fizzbuzz_list(100)) == 100",
        "fizzbuzz_list(15)[-1] == 'FizzBuzz'", "fizzbuzz_list(1) == ['1']"]),
    _p("def reverse_words(s: str) -> str",
       "Return the words of s (separated by any whitespace) in reverse order, joined by single spaces.",
       '''
def reverse_words(s):
    return " ".join(reversed(s.split()))
''', ["reverse_words('hello world') == 'world hello'", "reverse_words('a') == 'a'"],
       ["reverse_words('  the sky  is blue ') == 'blue is sky the'", "reverse_words('') == ''",
        "reverse_words('one two three') == 'three two one'", "reverse_words('x\\ty') == 'y x'"]),
    _p("def is_palindrome(s: str) -> bool",
       "True if s reads the same forwards and backwards, ignoring case and every character that "
       "is not a letter or a digit.", '''
def is_palindrome(s):
    t = [c.lower() for c in s if c.isalnum()]
    return t == t[::-1]
''', ["is_palindrome('racecar') == True", "is_palindrome('hello') == False"],
       ["is_palindrome('A man, a plan, a canal: Panama') == True", "is_palindrome('') == True",
        "is_palindrome('No lemon, no melon') == True", "is_palindrome('ab') == False",
        "is_palindrome('12321') == True"]),
    _p("def count_vowels(s: str) -> int",
       "Count the vowels (a, e, i, o, u, either case) in s.", '''
def count_vowels(s):
    return sum(1 for c in s.lower() if c in "aeiou")
''', ["count_vowels('hello') == 2", "count_vowels('xyz') == 0"],
       ["count_vowels('AEIOU') == 5", "count_vowels('') == 0", "count_vowels('Programming') == 3",
        "count_vowels('queue') == 4"]),
    _p("def capitalize_words(s: str) -> str",
       "Split s on single spaces and make each word's first character upper case and the rest "
       "lower case; join with single spaces (empty words stay empty).", '''
def capitalize_words(s):
    return " ".join(w[:1].upper() + w[1:].lower() for w in s.split(" "))
''', ["capitalize_words('hello world') == 'Hello World'", "capitalize_words('pYTHON') == 'Python'"],
       ["capitalize_words('') == ''", "capitalize_words('a b c') == 'A B C'",
        "capitalize_words('hello  world') == 'Hello  World'",
        "capitalize_words('1st place') == '1st Place'"]),
    _p("def run_length_encode(s: str) -> str",
       "Encode runs of the same character as the character followed by the run length: "
       "'aaabcc' -> 'a3b1c2'.", '''
def run_length_encode(s):
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(f"{s[i]}{j - i}")
        i = j
    return "".join(out)
''', ["run_length_encode('aaabcc') == 'a3b1c2'", "run_length_encode('') == ''"],
       ["run_length_encode('a') == 'a1'", "run_length_encode('abab') == 'a1b1a1b1'",
        "run_length_encode('zzzzzzzzzzzz') == 'z12'", "run_length_encode('aabbbaa') == 'a2b3a2'"]),
    _p("def run_length_decode(s: str) -> str",
       "Decode a string of (letter, count) pairs such as 'a3b1c2' -> 'aaabcc'; counts may have "
       "several digits.", '''
def run_length_decode(s):
    out, i = [], 0
    while i < len(s):
        ch = s[i]
        j = i + 1
        while j < len(s) and s[j].isdigit():
            j += 1
        out.append(ch * int(s[i + 1:j]))
        i = j
    return "".join(out)
''', ["run_length_decode('a3b1c2') == 'aaabcc'", "run_length_decode('') == ''"],
       ["run_length_decode('z12') == 'z' * 12", "run_length_decode('a1') == 'a'",
        "run_length_decode('x2y10') == 'xx' + 'y' * 10", "run_length_decode('a1b1a1') == 'aba'"]),
    _p("def caesar_shift(s: str, k: int) -> str",
       "Shift every ASCII letter k places along the alphabet (wrapping, keeping case; k may be "
       "negative or larger than 26); leave other characters unchanged.", '''
def caesar_shift(s, k):
    out = []
    for c in s:
        if "a" <= c <= "z":
            out.append(chr((ord(c) - 97 + k) % 26 + 97))
        elif "A" <= c <= "Z":
            out.append(chr((ord(c) - 65 + k) % 26 + 65))
        else:
            out.append(c)
    return "".join(out)
''', ["caesar_shift('abc', 1) == 'bcd'", "caesar_shift('xyz', 3) == 'abc'"],
       ["caesar_shift('Hello, World!', 13) == 'Uryyb, Jbeyq!'", "caesar_shift('abc', -1) == 'zab'",
        "caesar_shift('abc', 52) == 'abc'", "caesar_shift('', 5) == ''", "caesar_shift('Zz', 27) == 'Aa'"]),
    _p("def is_anagram(a: str, b: str) -> bool",
       "True if a and b contain the same letters the same number of times, ignoring case and spaces.",
       '''
def is_anagram(a, b):
    norm = lambda s: sorted(s.replace(" ", "").lower())
    return norm(a) == norm(b)
''', ["is_anagram('listen', 'silent') == True", "is_anagram('abc', 'abd') == False"],
       ["is_anagram('Dormitory', 'dirty room') == True", "is_anagram('', '') == True",
        "is_anagram('aab', 'abb') == False", "is_anagram('The eyes', 'They see') == True"]),
    _p("def longest_common_prefix(words: list) -> str",
       "The longest string that every word in the list starts with ('' for an empty list).", '''
def longest_common_prefix(words):
    if not words:
        return ""
    prefix = words[0]
    for w in words[1:]:
        while not w.startswith(prefix):
            prefix = prefix[:-1]
    return prefix
''', ["longest_common_prefix(['flower', 'flow', 'flight']) == 'fl'",
      "longest_common_prefix(['dog', 'car']) == ''"],
       ["longest_common_prefix([]) == ''", "longest_common_prefix(['same', 'same']) == 'same'",
        "longest_common_prefix(['a']) == 'a'",
        "longest_common_prefix(['prefix', 'pre', 'prepare']) == 'pre'"]),
    _p("def count_words(s: str) -> dict",
       "Map each word of s (split on whitespace, lower-cased) to the number of times it occurs.", '''
def count_words(s):
    counts = {}
    for w in s.lower().split():
        counts[w] = counts.get(w, 0) + 1
    return counts
''', ["count_words('a b a') == {'a': 2, 'b': 1}", "count_words('') == {}"],
       ["count_words('The the THE') == {'the': 3}", "count_words('x  y\\nz') == {'x': 1, 'y': 1, 'z': 1}",
        "count_words('one') == {'one': 1}"]),
    _p("def remove_duplicates(xs: list) -> list",
       "Return xs without repeated elements, keeping the first occurrence of each, in order.", '''
def remove_duplicates(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
''', ["remove_duplicates([1, 2, 1, 3]) == [1, 2, 3]", "remove_duplicates([]) == []"],
       ["remove_duplicates([5, 5, 5]) == [5]", "remove_duplicates(['b', 'a', 'b']) == ['b', 'a']",
        "remove_duplicates([3, 2, 1]) == [3, 2, 1]",
        "remove_duplicates([1, 2, 3, 2, 1, 4]) == [1, 2, 3, 4]"]),
    _p("def second_largest(xs: list)",
       "The second largest distinct value in xs, or None if xs has fewer than two distinct values.",
       '''
def second_largest(xs):
    values = sorted(set(xs))
    return values[-2] if len(values) >= 2 else None
''', ["second_largest([3, 1, 4, 1, 5]) == 4", "second_largest([7]) == None"],
       ["second_largest([2, 2, 2]) == None", "second_largest([]) == None", "second_largest([5, 5, 4]) == 4",
        "second_largest([-1, -2, -3]) == -2"]),
    _p("def flatten(xs: list) -> list",
       "Flatten arbitrarily nested lists into one list of the non-list elements, in order.", '''
def flatten(xs):
    out = []
    for x in xs:
        if isinstance(x, list):
            out.extend(flatten(x))
        else:
            out.append(x)
    return out
''', ["flatten([1, [2, 3]]) == [1, 2, 3]", "flatten([]) == []"],
       ["flatten([[[1]], 2, [3, [4, [5]]]]) == [1, 2, 3, 4, 5]", "flatten([[], [[]]]) == []",
        "flatten(['a', ['b']]) == ['a', 'b']", "flatten([1, 2]) == [1, 2]"]),
    _p("def chunk(xs: list, n: int) -> list",
       "Split xs into consecutive lists of length n (the last may be shorter).", '''
def chunk(xs, n):
    return [xs[i:i + n] for i in range(0, len(xs), n)]
''', ["chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]", "chunk([], 3) == []"],
       ["chunk([1, 2, 3], 3) == [[1, 2, 3]]", "chunk([1, 2, 3], 1) == [[1], [2], [3]]",
        "chunk([1, 2], 5) == [[1, 2]]", "chunk(list(range(6)), 4) == [[0, 1, 2, 3], [4, 5]]"]),
    _p("def rotate_left(xs: list, k: int) -> list",
       "Rotate xs left by k places (k >= 0, possibly larger than len(xs)); [] stays [].", '''
def rotate_left(xs, k):
    if not xs:
        return []
    k %= len(xs)
    return xs[k:] + xs[:k]
''', ["rotate_left([1, 2, 3, 4], 1) == [2, 3, 4, 1]", "rotate_left([], 3) == []"],
       ["rotate_left([1, 2, 3], 3) == [1, 2, 3]", "rotate_left([1, 2, 3], 5) == [3, 1, 2]",
        "rotate_left([1], 100) == [1]", "rotate_left([1, 2, 3, 4], 0) == [1, 2, 3, 4]"]),
    _p("def merge_sorted(a: list, b: list) -> list",
       "Merge two ascending lists into one ascending list (keep duplicates).", '''
def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
''', ["merge_sorted([1, 3], [2, 4]) == [1, 2, 3, 4]", "merge_sorted([], [1]) == [1]"],
       ["merge_sorted([1, 1], [1]) == [1, 1, 1]", "merge_sorted([], []) == []",
        "merge_sorted([5, 6, 7], [1, 2]) == [1, 2, 5, 6, 7]",
        "merge_sorted([-3, 0], [-1, 10]) == [-3, -1, 0, 10]"]),
    _p("def binary_search(xs: list, target: int) -> int",
       "Return an index of target in the ascending list xs of distinct ints, or -1 if absent.", '''
def binary_search(xs, target):
    lo, hi = 0, len(xs) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if xs[mid] == target:
            return mid
        if xs[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''', ["binary_search([1, 3, 5, 7], 5) == 2", "binary_search([1, 3, 5], 4) == -1"],
       ["binary_search([], 1) == -1", "binary_search([2], 2) == 0",
        "binary_search(list(range(0, 100, 3)), 99) == 33",
        "binary_search([1, 2, 3], 0) == -1", "binary_search([1, 2, 3], 3) == 2"]),
    _p("def max_subarray_sum(xs: list) -> int",
       "The largest sum of a non-empty contiguous sub-list of the non-empty list xs.", '''
def max_subarray_sum(xs):
    best = cur = xs[0]
    for x in xs[1:]:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best
''', ["max_subarray_sum([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6", "max_subarray_sum([1]) == 1"],
       ["max_subarray_sum([-3, -1, -2]) == -1", "max_subarray_sum([5, 4, -1, 7, 8]) == 23",
        "max_subarray_sum([0, 0]) == 0", "max_subarray_sum([2, -1, 2]) == 3"]),
    _p("def two_sum(nums: list, target: int)",
       "Return a tuple (i, j) with i < j and nums[i] + nums[j] == target, choosing the smallest j "
       "and then the smallest i; None if there is no such pair.", '''
def two_sum(nums, target):
    for j in range(len(nums)):
        for i in range(j):
            if nums[i] + nums[j] == target:
                return (i, j)
    return None
''', ["two_sum([2, 7, 11, 15], 9) == (0, 1)", "two_sum([1, 2], 10) == None"],
       ["two_sum([3, 2, 4], 6) == (1, 2)", "two_sum([3, 3], 6) == (0, 1)", "two_sum([], 0) == None",
        "two_sum([1, 5, 1, 5], 6) == (0, 1)", "two_sum([0, 4, 3, 0], 0) == (0, 3)"]),
    _p("def move_zeros(xs: list) -> list",
       "Return xs with every 0 moved to the end, the other elements keeping their order.", '''
def move_zeros(xs):
    return [x for x in xs if x != 0] + [0] * sum(1 for x in xs if x == 0)
''', ["move_zeros([0, 1, 0, 3, 12]) == [1, 3, 12, 0, 0]", "move_zeros([]) == []"],
       ["move_zeros([0, 0]) == [0, 0]", "move_zeros([1, 2]) == [1, 2]",
        "move_zeros([4, 0, 5, 0, 0, 6]) == [4, 5, 6, 0, 0, 0]"]),
    _p("def running_sum(xs: list) -> list",
       "Return the running totals: element i is xs[0] + ... + xs[i].", '''
def running_sum(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
''', ["running_sum([1, 2, 3]) == [1, 3, 6]", "running_sum([]) == []"],
       ["running_sum([5]) == [5]", "running_sum([1, -1, 1, -1]) == [1, 0, 1, 0]",
        "running_sum([0, 0, 7]) == [0, 0, 7]"]),
    _p("def pairwise_diff(xs: list) -> list",
       "Return the differences between neighbours: [xs[1] - xs[0], xs[2] - xs[1], ...].", '''
def pairwise_diff(xs):
    return [b - a for a, b in zip(xs, xs[1:])]
''', ["pairwise_diff([1, 4, 9]) == [3, 5]", "pairwise_diff([7]) == []"],
       ["pairwise_diff([]) == []", "pairwise_diff([5, 3, 1]) == [-2, -2]",
        "pairwise_diff([0, 0, 1, 1]) == [0, 1, 0]"]),
    _p("def most_common(xs: list)",
       "The element of the non-empty list xs that occurs most often; on a tie, the one whose first "
       "occurrence comes first.", '''
def most_common(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    best = max(counts.values())
    for x in xs:
        if counts[x] == best:
            return x
''', ["most_common([1, 2, 2, 3]) == 2", "most_common(['a']) == 'a'"],
       ["most_common([3, 1, 1, 3]) == 3", "most_common([1, 2, 3]) == 1", "most_common([5, 4, 4, 5, 4]) == 4",
        "most_common(['x', 'y', 'y']) == 'y'"]),
    _p("def is_sorted(xs: list) -> bool",
       "True if xs is in non-decreasing order.", '''
def is_sorted(xs):
    return all(a <= b for a, b in zip(xs, xs[1:]))
''', ["is_sorted([1, 2, 2, 3]) == True", "is_sorted([2, 1]) == False"],
       ["is_sorted([]) == True", "is_sorted([5]) == True", "is_sorted([1, 3, 2, 4]) == False",
        "is_sorted([-5, -5, 0]) == True"]),
    _p("def transpose(matrix: list) -> list",
       "Transpose a rectangular matrix given as a list of rows ([] stays []).", '''
def transpose(matrix):
    return [list(row) for row in zip(*matrix)]
''', ["transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]", "transpose([]) == []"],
       ["transpose([[1, 2, 3]]) == [[1], [2], [3]]", "transpose([[1], [2]]) == [[1, 2]]",
        "transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]"]),
    _p("def spiral_order(matrix: list) -> list",
       "The elements of a rectangular matrix in clockwise spiral order from the top-left corner.", '''
def spiral_order(matrix):
    out = []
    m = [list(r) for r in matrix]
    while m:
        out.extend(m.pop(0))
        m = [list(r) for r in zip(*m)][::-1]
    return out
''', ["spiral_order([[1, 2], [3, 4]]) == [1, 2, 4, 3]", "spiral_order([]) == []"],
       ["spiral_order([[1, 2, 3], [4, 5, 6], [7, 8, 9]]) == [1, 2, 3, 6, 9, 8, 7, 4, 5]",
        "spiral_order([[1, 2, 3, 4]]) == [1, 2, 3, 4]", "spiral_order([[1], [2], [3]]) == [1, 2, 3]",
        "spiral_order([[1, 2, 3], [4, 5, 6]]) == [1, 2, 3, 6, 5, 4]"]),
    _p("def gcd(a: int, b: int) -> int",
       "The greatest common divisor of two non-negative ints (gcd(0, 0) == 0).", '''
def gcd(a, b):
    while b:
        a, b = b, a % b
    return a
''', ["gcd(12, 18) == 6", "gcd(7, 5) == 1"],
       ["gcd(0, 0) == 0", "gcd(0, 9) == 9", "gcd(100, 75) == 25", "gcd(17, 17) == 17"]),
    _p("def lcm(a: int, b: int) -> int",
       "The least common multiple of two non-negative ints (0 if either is 0).", '''
def lcm(a, b):
    if a == 0 or b == 0:
        return 0
    x, y = a, b
    while y:
        x, y = y, x % y
    return a * b // x
''', ["lcm(4, 6) == 12", "lcm(0, 5) == 0"],
       ["lcm(7, 3) == 21", "lcm(10, 10) == 10", "lcm(12, 18) == 36", "lcm(1, 99) == 99"]),
    _p("def is_prime(n: int) -> bool",
       "True if n is a prime number (n may be any int).", '''
def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True
''', ["is_prime(7) == True", "is_prime(9) == False"],
       ["is_prime(1) == False", "is_prime(2) == True", "is_prime(-7) == False", "is_prime(97) == True",
        "is_prime(7919) == True", "is_prime(7917) == False"]),
    _p("def primes_up_to(n: int) -> list",
       "All primes p with p <= n, ascending.", '''
def primes_up_to(n):
    if n < 2:
        return []
    sieve = [True] * (n + 1)
    sieve[0] = sieve[1] = False
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            for j in range(i * i, n + 1, i):
                sieve[j] = False
    return [i for i, p in enumerate(sieve) if p]
''', ["primes_up_to(10) == [2, 3, 5, 7]", "primes_up_to(1) == []"],
       ["primes_up_to(2) == [2]", "primes_up_to(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]",
        "len(primes_up_to(1000)) == 168", "primes_up_to(-5) == []"]),
    _p("def factorial(n: int) -> int",
       "n! for n >= 0 (0! == 1).", '''
def factorial(n):
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out
''', ["factorial(5) == 120", "factorial(0) == 1"],
       ["factorial(1) == 1", "factorial(10) == 3628800", "factorial(20) == 2432902008176640000"]),
    _p("def fibonacci(n: int) -> int",
       "The n-th Fibonacci number with fibonacci(0) == 0 and fibonacci(1) == 1; must be fast for "
       "n up to 10000.", '''
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
''', ["fibonacci(10) == 55", "fibonacci(0) == 0"],
       ["fibonacci(1) == 1", "fibonacci(2) == 1", "fibonacci(50) == 12586269025",
        "len(str(fibonacci(10000))) == 2090"]),
    _p("def digit_sum(n: int) -> int",
       "The sum of the decimal digits of |n|.", '''
def digit_sum(n):
    return sum(int(c) for c in str(abs(n)))
''', ["digit_sum(123) == 6", "digit_sum(0) == 0"],
       ["digit_sum(-45) == 9", "digit_sum(99999) == 45", "digit_sum(1000001) == 2"]),
    _p("def is_perfect_square(n: int) -> bool",
       "True if n is the square of an integer (negative numbers are not).", '''
def is_perfect_square(n):
    if n < 0:
        return False
    r = int(n ** 0.5)
    while r * r > n:
        r -= 1
    while (r + 1) * (r + 1) <= n:
        r += 1
    return r * r == n
''', ["is_perfect_square(16) == True", "is_perfect_square(15) == False"],
       ["is_perfect_square(0) == True", "is_perfect_square(1) == True", "is_perfect_square(-4) == False",
        "is_perfect_square(10 ** 20) == True", "is_perfect_square(10 ** 20 + 1) == False"]),
    _p("def collatz_steps(n: int) -> int",
       "The number of Collatz steps (n -> n/2 if even, else 3n+1) to reach 1 from n >= 1.", '''
def collatz_steps(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
''', ["collatz_steps(1) == 0", "collatz_steps(6) == 8"],
       ["collatz_steps(2) == 1", "collatz_steps(27) == 111", "collatz_steps(16) == 4",
        "collatz_steps(7) == 16"]),
    _p("def to_binary(n: int) -> str",
       "The binary representation of n >= 0 without a prefix ('0' for 0).", '''
def to_binary(n):
    if n == 0:
        return "0"
    out = ""
    while n:
        out = str(n % 2) + out
        n //= 2
    return out
''', ["to_binary(5) == '101'", "to_binary(0) == '0'"],
       ["to_binary(1) == '1'", "to_binary(255) == '11111111'", "to_binary(1024) == '10000000000'"]),
    _p("def from_roman(s: str) -> int",
       "The value of a valid Roman numeral in upper case (I V X L C D M, subtractive pairs allowed).",
       '''
def from_roman(s):
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, c in enumerate(s):
        v = values[c]
        if i + 1 < len(s) and values[s[i + 1]] > v:
            total -= v
        else:
            total += v
    return total
''', ["from_roman('III') == 3", "from_roman('IV') == 4"],
       ["from_roman('IX') == 9", "from_roman('LVIII') == 58", "from_roman('MCMXCIV') == 1994",
        "from_roman('MMXXVI') == 2026"]),
    _p("def to_roman(n: int) -> str",
       "The Roman numeral for 1 <= n <= 3999 (subtractive notation: 4 is IV, 900 is CM).", '''
def to_roman(n):
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
             (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = ""
    for value, sym in table:
        while n >= value:
            out += sym
            n -= value
    return out
''', ["to_roman(3) == 'III'", "to_roman(4) == 'IV'"],
       ["to_roman(9) == 'IX'", "to_roman(58) == 'LVIII'", "to_roman(1994) == 'MCMXCIV'",
        "to_roman(3999) == 'MMMCMXCIX'"]),
    _p("def prime_factors(n: int) -> list",
       "The prime factors of n >= 2 in ascending order, with multiplicity.", '''
def prime_factors(n):
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out
''', ["prime_factors(12) == [2, 2, 3]", "prime_factors(7) == [7]"],
       ["prime_factors(2) == [2]", "prime_factors(360) == [2, 2, 2, 3, 3, 5]",
        "prime_factors(97 * 89) == [89, 97]",
        "prime_factors(1024) == [2] * 10"]),
    _p("def count_divisors(n: int) -> int",
       "The number of positive divisors of n >= 1.", '''
def count_divisors(n):
    count, i = 0, 1
    while i * i <= n:
        if n % i == 0:
            count += 1 if i * i == n else 2
        i += 1
    return count
''', ["count_divisors(6) == 4", "count_divisors(1) == 1"],
       ["count_divisors(7) == 2", "count_divisors(36) == 9", "count_divisors(100) == 9",
        "count_divisors(720720) == 240"]),
    _p("def sum_of_multiples(n: int) -> int",
       "The sum of the natural numbers below n that are multiples of 3 or 5.", '''
def sum_of_multiples(n):
    return sum(i for i in range(n) if i % 3 == 0 or i % 5 == 0)
''', ["sum_of_multiples(10) == 23", "sum_of_multiples(0) == 0"],
       ["sum_of_multiples(1) == 0", "sum_of_multiples(16) == 60", "sum_of_multiples(1000) == 233168"]),
    _p("def balanced_brackets(s: str) -> bool",
       "True if the brackets (), [] and {} in s are balanced and properly nested; other characters "
       "are ignored.", '''
def balanced_brackets(s):
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for c in s:
        if c in "([{":
            stack.append(c)
        elif c in pairs:
            if not stack or stack.pop() != pairs[c]:
                return False
    return not stack
''', ["balanced_brackets('([]{})') == True", "balanced_brackets('(]') == False"],
       ["balanced_brackets('') == True", "balanced_brackets('((') == False",
        "balanced_brackets('a(b[c]d)e') == True",
        "balanced_brackets('([)]') == False", "balanced_brackets(')(') == False"]),
    _p("def word_lengths(s: str) -> list",
       "The lengths of the whitespace-separated words of s, in order.", '''
def word_lengths(s):
    return [len(w) for w in s.split()]
''', ["word_lengths('hi there') == [2, 5]", "word_lengths('') == []"],
       ["word_lengths('  a  bb ccc ') == [1, 2, 3]", "word_lengths('word') == [4]"]),
    _p("def snake_to_camel(s: str) -> str",
       "Convert snake_case to camelCase: 'hello_world_foo' -> 'helloWorldFoo' (the first word "
       "stays as it is).", '''
def snake_to_camel(s):
    parts = s.split("_")
    return parts[0] + "".join(p[:1].upper() + p[1:] for p in parts[1:])
''', ["snake_to_camel('hello_world') == 'helloWorld'", "snake_to_camel('x') == 'x'"],
       ["snake_to_camel('hello_world_foo') == 'helloWorldFoo'", "snake_to_camel('') == ''",
        "snake_to_camel('get_http_response') == 'getHttpResponse'"]),
    _p("def camel_to_snake(s: str) -> str",
       "Convert camelCase to snake_case: each upper-case letter becomes '_' plus its lower case "
       "('helloWorldFoo' -> 'hello_world_foo'); a leading capital gets no underscore.", '''
def camel_to_snake(s):
    out = []
    for i, c in enumerate(s):
        if c.isupper():
            out.append(("_" if i else "") + c.lower())
        else:
            out.append(c)
    return "".join(out)
''', ["camel_to_snake('helloWorld') == 'hello_world'", "camel_to_snake('x') == 'x'"],
       ["camel_to_snake('helloWorldFoo') == 'hello_world_foo'", "camel_to_snake('') == ''",
        "camel_to_snake('Hello') == 'hello'", "camel_to_snake('aB') == 'a_b'"]),
    _p("def count_char_types(s: str) -> tuple",
       "Return (letters, digits, others): how many characters of s are letters (str.isalpha), "
       "digits (str.isdigit), and anything else.", '''
def count_char_types(s):
    letters = sum(c.isalpha() for c in s)
    digits = sum(c.isdigit() for c in s)
    return (letters, digits, len(s) - letters - digits)
''', ["count_char_types('ab1!') == (2, 1, 1)", "count_char_types('') == (0, 0, 0)"],
       ["count_char_types('hello world 42') == (10, 2, 2)", "count_char_types('123') == (0, 3, 0)",
        "count_char_types('***') == (0, 0, 3)"]),
    _p("def matrix_multiply(a: list, b: list) -> list",
       "The product of matrices a (n x m) and b (m x p), as lists of rows.", '''
def matrix_multiply(a, b):
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))]
            for i in range(len(a))]
''', ["matrix_multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]",
      "matrix_multiply([[2]], [[3]]) == [[6]]"],
       ["matrix_multiply([[1, 0], [0, 1]], [[4, 5], [6, 7]]) == [[4, 5], [6, 7]]",
        "matrix_multiply([[1, 2, 3]], [[1], [2], [3]]) == [[14]]",
        "matrix_multiply([[1], [2]], [[3, 4]]) == [[3, 4], [6, 8]]"]),
    _p("def pascal_row(n: int) -> list",
       "Row n of Pascal's triangle (row 0 is [1]).", '''
def pascal_row(n):
    row = [1]
    for _ in range(n):
        row = [a + b for a, b in zip([0] + row, row + [0])]
    return row
''', ["pascal_row(0) == [1]", "pascal_row(3) == [1, 3, 3, 1]"],
       ["pascal_row(1) == [1, 1]", "pascal_row(4) == [1, 4, 6, 4, 1]", "sum(pascal_row(10)) == 1024",
        "pascal_row(6)[3] == 20"]),
    _p("def triangle_type(a: int, b: int, c: int) -> str",
       "Classify side lengths: 'invalid' unless all are positive and each is less than the sum of "
       "the other two; else 'equilateral', 'isosceles' (exactly two equal) or 'scalene'.", '''
def triangle_type(a, b, c):
    x, y, z = sorted((a, b, c))
    if x <= 0 or x + y <= z:
        return "invalid"
    if x == z:
        return "equilateral"
    if x == y or y == z:
        return "isosceles"
    return "scalene"
''', ["triangle_type(3, 3, 3) == 'equilateral'", "triangle_type(3, 4, 5) == 'scalene'"],
       ["triangle_type(2, 2, 3) == 'isosceles'", "triangle_type(1, 2, 3) == 'invalid'",
        "triangle_type(0, 1, 1) == 'invalid'", "triangle_type(5, 3, 5) == 'isosceles'"]),
    _p("def leap_year(year: int) -> bool",
       "True for Gregorian leap years: divisible by 4, except centuries not divisible by 400.", '''
def leap_year(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''', ["leap_year(2024) == True", "leap_year(2023) == False"],
       ["leap_year(1900) == False", "leap_year(2000) == True", "leap_year(2100) == False",
        "leap_year(1996) == True"]),
    _p("def median(xs: list) -> float",
       "The median of a non-empty list of numbers (the mean of the two middle values when the "
       "length is even).", '''
def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
''', ["median([3, 1, 2]) == 2", "median([4, 1, 3, 2]) == 2.5"],
       ["median([5]) == 5", "median([1, 1, 1, 9]) == 1", "median([-5, 5]) == 0",
        "median([10, 2, 38, 23, 38]) == 23"]),
    _p("def hamming_distance(a: str, b: str) -> int",
       "The number of positions where the equal-length strings a and b differ.", '''
def hamming_distance(a, b):
    return sum(x != y for x, y in zip(a, b))
''', ["hamming_distance('karolin', 'kathrin') == 3", "hamming_distance('', '') == 0"],
       ["hamming_distance('abc', 'abc') == 0", "hamming_distance('1011101', '1001001') == 2",
        "hamming_distance('aaaa', 'bbbb') == 4"]),
    _p("def spell_digits(n: int) -> str",
       "The decimal digits of n >= 0 as English words separated by spaces: 203 -> 'two zero three'.",
       '''
def spell_digits(n):
    words = "zero one two three four five six seven eight nine".split()
    return " ".join(words[int(c)] for c in str(n))
''', ["spell_digits(203) == 'two zero three'", "spell_digits(0) == 'zero'"],
       ["spell_digits(7) == 'seven'",
        "spell_digits(1234567890) == 'one two three four five six seven eight nine zero'"]),
    _p("def int_to_base(n: int, base: int) -> str",
       "n >= 0 written in base 2..36 with digits 0-9 then lower-case a-z ('0' for 0).", '''
def int_to_base(n, base):
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    if n == 0:
        return "0"
    out = ""
    while n:
        out = digits[n % base] + out
        n //= base
    return out
''', ["int_to_base(255, 16) == 'ff'", "int_to_base(0, 7) == '0'"],
       ["int_to_base(5, 2) == '101'", "int_to_base(35, 36) == 'z'", "int_to_base(100, 10) == '100'",
        "int_to_base(64, 8) == '100'"]),
    _p("def max_profit(prices: list) -> int",
       "The best profit from buying once and selling once later (0 if no profit is possible).", '''
def max_profit(prices):
    best, low = 0, None
    for p in prices:
        if low is None or p < low:
            low = p
        best = max(best, p - low)
    return best
''', ["max_profit([7, 1, 5, 3, 6, 4]) == 5", "max_profit([7, 6, 4]) == 0"],
       ["max_profit([]) == 0", "max_profit([1, 2]) == 1", "max_profit([2, 4, 1, 7]) == 6",
        "max_profit([3]) == 0"]),
    _p("def valid_ipv4(s: str) -> bool",
       "True if s is a dotted-quad IPv4 address: four decimal parts 0..255, no leading zeros "
       "(except '0' itself), digits only.", '''
def valid_ipv4(s):
    parts = s.split(".")
    if len(parts) != 4:
        return False
    for p in parts:
        if not p.isdigit() or not p.isascii() or (len(p) > 1 and p[0] == "0") or int(p) > 255:
            return False
    return True
''', ["valid_ipv4('192.168.0.1') == True", "valid_ipv4('256.1.1.1') == False"],
       ["valid_ipv4('0.0.0.0') == True", "valid_ipv4('1.2.3') == False", "valid_ipv4('01.2.3.4') == False",
        "valid_ipv4('1.2.3.a') == False", "valid_ipv4('255.255.255.255') == True",
        "valid_ipv4('1..2.3') == False"]),
    _p("def count_islands(grid: list) -> int",
       "The number of groups of 1s in a grid of 0/1 rows, where cells connect up, down, left, right.",
       '''
def count_islands(grid):
    seen = set()
    count = 0
    for r in range(len(grid)):
        for c in range(len(grid[r])):
            if grid[r][c] == 1 and (r, c) not in seen:
                count += 1
                stack = [(r, c)]
                while stack:
                    y, x = stack.pop()
                    inside = 0 <= y < len(grid) and 0 <= x < len(grid[y])
                    if (y, x) in seen or not inside or grid[y][x] != 1:
                        continue
                    seen.add((y, x))
                    stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
    return count
''', ["count_islands([[1, 0], [0, 1]]) == 2", "count_islands([]) == 0"],
       ["count_islands([[1, 1], [1, 1]]) == 1", "count_islands([[0, 0]]) == 0",
        "count_islands([[1, 0, 1], [1, 0, 1], [0, 1, 0]]) == 3",
        "count_islands([[1, 1, 0], [0, 1, 0], [0, 1, 1]]) == 1"]),
    _p("def digital_root(n: int) -> int",
       "Repeatedly sum the decimal digits of n >= 0 until one digit remains.", '''
def digital_root(n):
    while n >= 10:
        n = sum(int(c) for c in str(n))
    return n
''', ["digital_root(38) == 2", "digital_root(0) == 0"],
       ["digital_root(9) == 9", "digital_root(99999) == 9", "digital_root(123456789) == 9",
        "digital_root(10) == 1"]),
    _p("def interleave(a: list, b: list) -> list",
       "Alternate elements of a and b starting with a; when one runs out, append the rest of the other.",
       '''
def interleave(a, b):
    out = []
    for i in range(max(len(a), len(b))):
        if i < len(a):
            out.append(a[i])
        if i < len(b):
            out.append(b[i])
    return out
''', ["interleave([1, 2], ['a', 'b']) == [1, 'a', 2, 'b']", "interleave([], []) == []"],
       ["interleave([1, 2, 3], [9]) == [1, 9, 2, 3]", "interleave([], [4, 5]) == [4, 5]",
        "interleave([1], []) == [1]"]),
    _p("def char_frequency_sorted(s: str) -> list",
       "Return (char, count) tuples for the characters of s, most frequent first; ties in "
       "alphabetical (code point) order.", '''
def char_frequency_sorted(s):
    counts = {}
    for c in s:
        counts[c] = counts.get(c, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
''', ["char_frequency_sorted('aab') == [('a', 2), ('b', 1)]", "char_frequency_sorted('') == []"],
       ["char_frequency_sorted('banana') == [('a', 3), ('n', 2), ('b', 1)]",
        "char_frequency_sorted('cba') == [('a', 1), ('b', 1), ('c', 1)]",
        "char_frequency_sorted('zzy') == [('z', 2), ('y', 1)]"]),
    _p("def compress_ranges(xs: list) -> str",
       "Describe a sorted list of distinct ints as comma-separated ranges: [1, 2, 3, 5, 7, 8] -> "
       "'1-3,5,7-8'.", '''
def compress_ranges(xs):
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
''', ["compress_ranges([1, 2, 3, 5, 7, 8]) == '1-3,5,7-8'", "compress_ranges([]) == ''"],
       ["compress_ranges([4]) == '4'", "compress_ranges([1, 3, 5]) == '1,3,5'",
        "compress_ranges([-2, -1, 0]) == '-2-0'",
        "compress_ranges([1, 2]) == '1-2'"]),
    _p("def acronym(s: str) -> str",
       "The upper-case first letters of the words of s, where words are separated by spaces or "
       "hyphens: 'portable network-graphics' -> 'PNG'.", '''
def acronym(s):
    return "".join(w[0].upper() for w in s.replace("-", " ").split())
''', ["acronym('portable network graphics') == 'PNG'", "acronym('') == ''"],
       ["acronym('Complementary metal-oxide semiconductor') == 'CMOS'",
        "acronym('as soon as possible') == 'ASAP'",
        "acronym('x') == 'X'"]),
    _p("def sum_even_fibonacci(limit: int) -> int",
       "The sum of the even Fibonacci numbers (1, 2, 3, 5, 8, ...) that do not exceed limit.", '''
def sum_even_fibonacci(limit):
    a, b, total = 1, 2, 0
    while a <= limit:
        if a % 2 == 0:
            total += a
        a, b = b, a + b
    return total
''', ["sum_even_fibonacci(10) == 10", "sum_even_fibonacci(1) == 0"],
       ["sum_even_fibonacci(2) == 2", "sum_even_fibonacci(100) == 44",
        "sum_even_fibonacci(4000000) == 4613732"]),
]
