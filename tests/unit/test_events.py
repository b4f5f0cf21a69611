import pytest

from meshopt.errors import InputError
from meshopt.sim.events import check_events, parse_event
from meshopt.topology.model import LinkProps, Node, Topology


def test_link_event() -> None:
    ev = parse_event("at=30s link=a-b delay=200ms loss=2%")
    assert ev.at_s == 30 and ev.link == ("a", "b") and ev.both_ways
    assert ev.changes == {"delay_ms": 200.0, "loss": 0.02}


def test_one_way_and_node_events() -> None:
    assert not parse_event("at=1m link=a->b delay=5ms").both_ways
    ev = parse_event("at=60s node=c down")
    assert ev.at_s == 60 and ev.node == "c" and ev.state == "down"


@pytest.mark.parametrize(
    "text",
    [
        "link=a-b delay=1ms",  # no time
        "at=1s",  # no target
        "at=1s node=c",  # no state
        "at=1s node=c down link=a-b",  # two targets
        "at=1s link=a-b",  # nothing to change
        "at=1s link=ab delay=1ms",  # not a pair
        "at=1s link=a-b delay=fast",  # bad unit
        "at=1s link=a-b colour=red",  # unknown key
        "at=xs link=a-b delay=1ms",
        'at=1s link="a-b',
    ],
)
def test_bad_events_raise_input_error(text: str) -> None:
    with pytest.raises(InputError):
        parse_event(text)


def test_unknown_node_in_event() -> None:
    t = Topology.from_links("t", [Node("a"), Node("b")], LinkProps(delay_ms=1.0))
    with pytest.raises(InputError, match="unknown node 'z'"):
        check_events([parse_event("at=1s node=z down")], t)
