"""The bulk settings' memory: arrays per source that behave as the dict they replace."""

from __future__ import annotations

import random

from meshopt.controller.bulk_memory import BulkMemory, Tuned
from meshopt.install.tuning import TcpTuning


def _t(mtu: int) -> TcpTuning:
    return TcpTuning(mtu=mtu, advmss=mtu - 40, window=None, initcwnd=10, initrwnd=None)


def test_what_is_put_is_got_back_for_first_and_further_prefixes() -> None:
    m = BulkMemory()
    m.align(["a", "b", "c"], ["10.0.0.1/32", "10.0.0.2/32", None])
    assert m.get("a", 1, "10.0.0.2/32") is None
    one = Tuned(2, 1420, 12.5, None, _t(1420))
    two = Tuned(1, 1380, None, 80.0, None)
    m.put("a", 1, "10.0.0.2/32", one)
    m.put("a", 1, "fd00::2/128", two)  # b's second prefix
    assert m.get("a", 1, "10.0.0.2/32") == one
    assert m.get("a", 1, "fd00::2/128") == two
    assert m.get("b", 1, "10.0.0.2/32") is None  # per source
    assert len(m) == 2
    base = m.base("a")
    assert base.shape == (4, 3) and base[0, 1] == 2 and base[1, 1] == 1420
    assert all(x != x for x in base[:, 0])  # NaN: nothing for a -> a


def test_settings_are_listed_once_per_value() -> None:
    m = BulkMemory()
    m.align([f"n{i}" for i in range(50)], [f"10.0.0.{i}/32" for i in range(50)])
    for i in range(50):
        m.put("n0", i, f"10.0.0.{i}/32", Tuned(1, 1420, 1.0, 1.0, _t(1420 - 20 * (i % 3))))
    assert len(m.settings) == 3
    assert m.get("n0", 4, "10.0.0.4/32") == Tuned(1, 1420, 1.0, 1.0, _t(1400))


def test_align_moves_entries_with_their_nodes_and_forgets_the_rest() -> None:
    rng = random.Random(3)
    names = [f"n{i}" for i in range(20)]
    first = [f"10.0.0.{i}/32" for i in range(20)]
    m = BulkMemory()
    m.align(names, first)
    want: dict[tuple[str, str], Tuned] = {}
    for _ in range(100):
        s, d = rng.randrange(20), rng.randrange(20)
        t = Tuned(rng.randrange(1, 4), 1420, rng.random() * 50, None, _t(1420))
        m.put(names[s], d, first[d], t)
        want[(names[s], names[d])] = t
    copy = m.copy()
    order = list(range(20))
    rng.shuffle(order)
    order = [i for i in order if i not in (3, 7)]  # n3 and n7 leave
    names2 = [names[i] for i in order] + ["new"]
    first2 = [first[i] for i in order] + ["10.0.1.1/32"]
    m.align(names2, first2)
    for (s, d), t in want.items():
        if {s, d} & {"n3", "n7"}:
            continue
        assert m.get(s, names2.index(d), first[names.index(d)]) == t
    assert "n3" not in m.rows and "n7" not in m.rows
    assert m.get("n0", names2.index("new"), "10.0.1.1/32") is None
    # A node whose first prefix changed starts afresh; the copy was not touched.
    i = names2.index("n5")
    first3 = list(first2)
    first3[i] = "10.9.9.9/32"
    m.align(names2, first3)
    assert all(m.get(s, i, "10.9.9.9/32") is None for s in names2)
    assert copy.names == names and len(copy) == len(want)
