"""Ordinary, correct programs pass the sandbox with reward 1: its defences must not fail correct code (GRPO
would learn to avoid the standard library). Each program is what a model might write for a small task, with
the kind of tests a dataset row carries."""

import pytest

from reward_fns.code import code_tests

ORDINARY = {
    "namedtuple": (
        "from collections import namedtuple\nPoint = namedtuple('Point', 'x y')\n"
        "def midpoint(a, b):\n    return Point((a.x + b.x) / 2, (a.y + b.y) / 2)",
        "assert midpoint(Point(0, 0), Point(2, 4)) == Point(1.0, 2.0)\n"
        "assert midpoint(Point(0, 0), Point(2, 4)).y == 2",
    ),
    "typing NamedTuple": (
        "from typing import NamedTuple\nclass Pair(NamedTuple):\n    a: int\n    b: int\n"
        "def swap(p):\n    return Pair(p.b, p.a)",
        "assert swap(Pair(1, 2)) == (2, 1)",
    ),
    "enum class": (
        "from enum import Enum\nclass Color(Enum):\n    RED = 1\n    GREEN = 2\n"
        "def name_of(value):\n    return Color(value).name",
        "assert name_of(2) == 'GREEN'",
    ),
    "enum functional API": (
        "from enum import Enum, IntEnum\nShape = Enum('Shape', 'CIRCLE SQUARE')\nLevel = IntEnum('Level', 'LOW HIGH')\n"
        "def sides(shape):\n    return {'CIRCLE': 0, 'SQUARE': 4}[shape.name]",
        "assert sides(Shape.SQUARE) == 4\nassert Level.HIGH > Level.LOW",
    ),
    "flag": (
        "from enum import Flag, auto\nclass Perm(Flag):\n    R = auto()\n    W = auto()\n"
        "def can_write(p):\n    return bool(p & Perm.W)",
        "assert can_write(Perm.R | Perm.W) is True\nassert can_write(Perm.R) is False",
    ),
    "dataclass compared by value": (
        "from dataclasses import dataclass, field\n@dataclass\nclass Item:\n    name: str\n"
        "    tags: list = field(default_factory=list)\n"
        "def parse(text):\n    name, *tags = text.split(',')\n    return Item(name, tags)",
        "assert parse('a,x,y') == Item('a', ['x', 'y'])\nassert parse('b') != Item('a')",
    ),
    "frozen ordered dataclass": (
        "from dataclasses import dataclass\n@dataclass(frozen=True, order=True)\n"
        "class Version:\n    major: int\n    minor: int\n"
        "def newest(versions):\n    return max(versions)",
        "assert newest([Version(1, 2), Version(2, 0), Version(1, 9)]) == Version(2, 0)\n"
        "assert Version(1, 2) < Version(1, 3)\nassert len({Version(1, 2), Version(1, 2)}) == 1",
    ),
    "logging": (
        "import logging\nlogging.basicConfig(level=logging.INFO)\nlog = logging.getLogger('solver')\n"
        "def total(xs):\n    log.info('summing %d items', len(xs))\n    log.debug('never shown')\n    return sum(xs)",
        "assert total([1, 2, 3]) == 6",
    ),
    "logging with stack info": (
        "import logging\nlog = logging.getLogger(__name__)\n"
        "def safe_div(a, b):\n    try:\n        return a / b\n    except ZeroDivisionError:\n"
        "        log.exception('division failed')\n        log.warning('where', stack_info=True)\n        return None",
        "assert safe_div(1, 0) is None\nassert safe_div(4, 2) == 2",
    ),
    "traceback.format_exc": (
        "import traceback\ndef describe(f):\n    try:\n        f()\n    except Exception:\n"
        "        return traceback.format_exc().strip().splitlines()[-1]\n    return 'ok'",
        "assert describe(lambda: 1 / 0) == 'ZeroDivisionError: division by zero'\nassert describe(lambda: 1) == 'ok'",
    ),
    "traceback.extract_stack": (
        "import traceback\ndef depth():\n    return len(traceback.extract_stack()) > 0",
        "assert depth() is True",
    ),
    "inspect.signature": (
        "import inspect\ndef arity(f):\n    return len(inspect.signature(f).parameters)",
        "assert arity(lambda a, b, c=1: None) == 3",
    ),
    "warnings": (
        "import warnings\ndef old(x):\n"
        "    warnings.warn('old is deprecated', DeprecationWarning, stacklevel=2)\n    return x + 1",
        "import warnings\nwith warnings.catch_warnings(record=True) as caught:\n    warnings.simplefilter('always')\n"
        "    assert old(1) == 2\nassert caught and caught[0].category is DeprecationWarning",
    ),
    "unused socket and subprocess imports": (
        "import socket\nimport subprocess\nimport os\ndef add(a, b):\n    return a + b",
        "assert add(2, 3) == 5",
    ),
    "re": (
        "import re\ndef emails(text):\n    return re.findall(r'[\\w.]+@[\\w.]+\\.\\w+', text)",
        "assert emails('a@b.com and c.d@e.org') == ['a@b.com', 'c.d@e.org']",
    ),
    "itertools": (
        "from itertools import combinations, groupby, accumulate\n"
        "def pairs(xs):\n    return list(combinations(xs, 2))\n"
        "def runs(s):\n    return [(k, len(list(g))) for k, g in groupby(s)]\n"
        "def prefix(xs):\n    return list(accumulate(xs))",
        "assert pairs([1, 2, 3]) == [(1, 2), (1, 3), (2, 3)]\nassert runs('aab') == [('a', 2), ('b', 1)]\n"
        "assert prefix([1, 2, 3]) == [1, 3, 6]",
    ),
    "functools": (
        "from functools import lru_cache, reduce, partial, wraps, cached_property, singledispatch\n"
        "@lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "def product(xs):\n    return reduce(lambda a, b: a * b, xs, 1)\n"
        "@singledispatch\ndef kind(x):\n    return 'other'\n@kind.register\ndef _(x: int):\n    return 'int'\n"
        "class Circle:\n    def __init__(self, r):\n        self.r = r\n    @cached_property\n    def area(self):\n"
        "        return 3 * self.r ** 2",
        "assert fib(30) == 832040\nassert product([2, 3, 4]) == 24\nassert kind(1) == 'int' and kind('a') == 'other'\n"
        "assert Circle(2).area == 12",
    ),
    "heapq and bisect": (
        "import heapq, bisect\ndef k_smallest(xs, k):\n    return heapq.nsmallest(k, xs)\n"
        "def insert_sorted(xs, x):\n    bisect.insort(xs, x)\n    return xs",
        "assert k_smallest([5, 1, 4, 2], 2) == [1, 2]\nassert insert_sorted([1, 3], 2) == [1, 2, 3]",
    ),
    "decimal": (
        "from decimal import Decimal, ROUND_HALF_UP\ndef money(x):\n"
        "    return Decimal(x).quantize(Decimal('0.01'), rounding=ROUND_HALF_UP)",
        "from decimal import Decimal\nassert money('2.345') == Decimal('2.35')",
    ),
    "fractions": (
        "from fractions import Fraction\ndef harmonic(n):\n    return sum(Fraction(1, k) for k in range(1, n + 1))",
        "from fractions import Fraction\nassert harmonic(3) == Fraction(11, 6)",
    ),
    "json": (
        "import json\ndef roundtrip(obj):\n    return json.loads(json.dumps(obj, sort_keys=True))",
        "assert roundtrip({'b': [1, 2], 'a': None}) == {'a': None, 'b': [1, 2]}",
    ),
    "datetime": (
        "from datetime import date, timedelta, datetime\ndef next_day(s):\n"
        "    return (datetime.strptime(s, '%Y-%m-%d').date() + timedelta(days=1)).isoformat()",
        "assert next_day('2024-02-28') == '2024-02-29'",
    ),
    "threading": (
        "import threading\ndef parallel_squares(xs):\n    out = [None] * len(xs)\n"
        "    def work(i):\n        out[i] = xs[i] ** 2\n"
        "    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]\n"
        "    for t in threads:\n        t.start()\n    for t in threads:\n        t.join()\n    return out",
        "assert parallel_squares([1, 2, 3]) == [1, 4, 9]",
    ),
    "concurrent.futures": (
        "from concurrent.futures import ThreadPoolExecutor\ndef doubled(xs):\n"
        "    with ThreadPoolExecutor(2) as pool:\n        return list(pool.map(lambda x: 2 * x, xs))",
        "assert doubled([1, 2]) == [2, 4]",
    ),
    "collections Counter/deque/defaultdict/OrderedDict": (
        "from collections import Counter, deque, defaultdict, OrderedDict\n"
        "def top(words):\n    return Counter(words).most_common(1)[0][0]\n"
        "def rotate(xs, k):\n    d = deque(xs)\n    d.rotate(k)\n    return list(d)\n"
        "def group(pairs):\n    g = defaultdict(list)\n    for k, v in pairs:\n        g[k].append(v)\n"
        "    return dict(g)",
        "assert top(['a', 'b', 'a']) == 'a'\nassert rotate([1, 2, 3], 1) == [3, 1, 2]\n"
        "assert group([('x', 1), ('x', 2)]) == {'x': [1, 2]}",
    ),
    "string and textwrap": (
        "import string, textwrap\ndef caesar(s, k):\n    a = string.ascii_lowercase\n"
        "    return s.translate(str.maketrans(a, a[k:] + a[:k]))\n"
        "def wrap(s):\n    return textwrap.wrap(s, 5)",
        "assert caesar('abc', 1) == 'bcd'\nassert wrap('hello world') == ['hello', 'world']",
    ),
    "math and statistics": (
        "import math, statistics\ndef hyp(a, b):\n    return math.hypot(a, b)\n"
        "def mid(xs):\n    return statistics.median(xs)",
        "assert hyp(3, 4) == 5.0\nassert mid([3, 1, 2]) == 2",
    ),
    "random with a seed": (
        "import random\ndef shuffled(xs, seed):\n    rng = random.Random(seed)\n    ys = list(xs)\n"
        "    rng.shuffle(ys)\n    return ys",
        "assert sorted(shuffled(range(5), 1)) == [0, 1, 2, 3, 4]\n"
        "assert shuffled(range(5), 1) == shuffled(range(5), 1)",
    ),
    "hashlib": (
        "import hashlib\ndef digest(s):\n    return hashlib.sha256(s.encode()).hexdigest()[:8]",
        "assert digest('abc') == 'ba7816bf'",
    ),
    "copy and operator": (
        "import copy, operator\ndef clone(x):\n    return copy.deepcopy(x)\n"
        "def by_second(pairs):\n    return sorted(pairs, key=operator.itemgetter(1))",
        "a = [[1], [2]]\nb = clone(a)\nb[0].append(9)\nassert a == [[1], [2]]\n"
        "assert by_second([(1, 'b'), (2, 'a')]) == [(2, 'a'), (1, 'b')]",
    ),
    "abc and contextlib": (
        "from abc import ABC, abstractmethod\nfrom contextlib import contextmanager, suppress\n"
        "class Shape(ABC):\n    @abstractmethod\n    def area(self): ...\n"
        "class Square(Shape):\n    def __init__(self, s):\n        self.s = s\n"
        "    def area(self):\n        return self.s ** 2\n"
        "@contextmanager\ndef tag(out):\n    out.append('<')\n    yield\n    out.append('>')\n"
        "def guarded():\n    with suppress(KeyError):\n        return {}['x']\n    return 'missing'",
        "assert Square(3).area() == 9\nout = []\nwith tag(out):\n    out.append('x')\nassert out == ['<', 'x', '>']\n"
        "assert guarded() == 'missing'",
    ),
    "generators": (
        "def chunks(xs, n):\n    for i in range(0, len(xs), n):\n        yield xs[i:i + n]\n"
        "def running():\n    total = 0\n    while True:\n        x = yield total\n        total += x",
        "assert list(chunks([1, 2, 3], 2)) == [[1, 2], [3]]\ng = running()\nnext(g)\ng.send(2)\nassert g.send(3) == 5",
    ),
    "exceptions and custom errors": (
        "class ParseError(ValueError):\n    pass\ndef parse_int(s):\n    try:\n        return int(s)\n"
        "    except ValueError as exc:\n        raise ParseError(f'bad: {s!r}') from exc",
        "try:\n    parse_int('x')\nexcept ValueError as e:\n    assert 'bad' in str(e) and e.__cause__ is not None\n"
        "else:\n    raise AssertionError('no error')\nassert parse_int('7') == 7",
    ),
    "unittest TestCase": (
        "def is_palindrome(s):\n    s = ''.join(c.lower() for c in s if c.isalnum())\n    return s == s[::-1]",
        "import unittest\nclass T(unittest.TestCase):\n    def test_yes(self):\n"
        "        self.assertTrue(is_palindrome('A man, a plan, a canal: Panama'))\n"
        "    def test_no(self):\n        self.assertFalse(is_palindrome('abc'))\n"
        "    def test_raises(self):\n        with self.assertRaises(TypeError):\n            is_palindrome(None)",
    ),
    "asyncio": (
        "import asyncio\nasync def twice(x):\n    await asyncio.sleep(0)\n    return 2 * x\n"
        "def run_all(xs):\n    async def main():\n        return await asyncio.gather(*(twice(x) for x in xs))\n"
        "    return asyncio.run(main())",
        "assert run_all([1, 2]) == [2, 4]",
    ),
    "files in the working directory": (
        "import os, tempfile\ndef write_and_read(text):\n    with open('notes.txt', 'w') as f:\n        f.write(text)\n"
        "    with tempfile.TemporaryDirectory() as d:\n        p = os.path.join(d, 'x')\n"
        "        open(p, 'w').write('y')\n    return open('notes.txt').read()",
        "assert write_and_read('hi') == 'hi'",
    ),
    "print to stdout": (
        "def shout(s):\n    print(s.upper())\n    return s.upper()",
        "assert shout('hey') == 'HEY'",
    ),
}


@pytest.mark.parametrize("name", list(ORDINARY))
def test_ordinary_program_passes(name: str) -> None:
    program, tests = ORDINARY[name]
    assert code_tests(completions=[program], tests=[tests]) == [1.0], name


def test_the_corpus_is_large_enough() -> None:
    assert len(ORDINARY) >= 30
