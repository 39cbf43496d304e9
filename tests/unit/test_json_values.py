"""The integer and number checks of decoded JSON (pd_protocol.json_values)."""

from pd_protocol.json_values import is_int, is_number


def test_a_bool_is_neither_an_integer_nor_a_number():
    assert not is_int(True)
    assert not is_number(False)


def test_integers_are_integers_and_numbers_floats_only_numbers():
    assert is_int(0) and is_int(-3) and is_number(7)
    assert is_number(0.5) and not is_int(0.5)


def test_strings_and_none_are_neither():
    assert not is_int("1") and not is_number("1.0")
    assert not is_int(None) and not is_number(None)
