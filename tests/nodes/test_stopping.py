from engine.sequence import finish_reason
from prefill_node.stop_strings import StopStrings


def test_finish_reason_order():
    assert finish_reason(2, (2,), [2], 5, 5) == "eos"
    assert finish_reason(3, (2,), [3], 5, 5) == "stop"
    assert finish_reason(4, (2,), [3], 5, 5) == "length"
    assert finish_reason(4, (2,), [3], 4, 5) == ""


def test_stop_strings_across_pieces():
    stops = StopStrings(["\n\n", "END"])
    out = []
    for piece in ["Hello", " E", "N", "x\n", "\nmore"]:
        text, hit = stops.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello ENx" and hit


def test_stop_strings_hold_back_only_a_possible_prefix_and_flush():
    stops = StopStrings(["STOP"])
    assert stops.push("abcST") == ("abc", False)
    assert stops.push("x") == ("STx", False)
    assert stops.push("STO") == ("", False)
    assert stops.flush() == "STO"
    assert StopStrings([]).push("any") == ("any", False)
