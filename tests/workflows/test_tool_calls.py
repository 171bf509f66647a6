"""Tool-call parsing: well-formed calls become ``ToolCall``s, malformed ones ``ToolCallError``s
(never an exception), and the text around the calls is the turn's content."""

from __future__ import annotations

import pytest

from meshrl.workflows.tool_calls import (
    MAX_CALLS_PER_TURN,
    ToolCall,
    ToolCallError,
    get_parser,
    parse_hermes,
    parse_llama3,
)


def test_hermes_calls_are_parsed_in_order_with_the_content_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "12*34"}}\n</tool_call>\n<tool_call>{"name": "python", '
            '"arguments": {"code": "print(\\"}\\")"}}</tool_call>')
    turn = parse_hermes(text)
    assert turn.content == "Let me compute."
    assert turn.calls == (ToolCall("calculator", {"expression": "12*34"}),
                          ToolCall("python", {"code": 'print("}")'}))


@pytest.mark.parametrize("text,needle", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
     "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "not closed"),
])
def test_malformed_hermes_calls_become_errors_not_exceptions(text, needle):
    (call,) = parse_hermes(text).calls
    assert isinstance(call, ToolCallError) and needle in call.message


def test_hermes_arguments_given_as_a_json_string_are_decoded():
    turn = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert turn.calls == (ToolCall("f", {"x": 1}),)


def test_a_turn_without_calls_is_all_content():
    assert parse_hermes("The answer is 42.").calls == ()
    assert parse_llama3("The answer is 42.").content == "The answer is 42."


def test_llama3_json_calls_with_and_without_the_python_tag():
    one = parse_llama3('{"name": "calculator", "parameters": {"expression": "2+2"}}')
    two = parse_llama3('<|python_tag|>{"name": "a", "parameters": {"s": "x;{y}"}}; '
                       '{"name": "b", "parameters": {}}')
    assert one.calls == (ToolCall("calculator", {"expression": "2+2"}),)
    assert two.calls == (ToolCall("a", {"s": "x;{y}"}), ToolCall("b", {}))


def test_llama3_pythonic_calls_take_literal_arguments_only():
    ok = parse_llama3('[calculator(expression="2+2"), python(code="print(1)")]')
    bad = parse_llama3('[calculator(expression=__import__("os"))]')
    assert ok.calls == (ToolCall("calculator", {"expression": "2+2"}),
                        ToolCall("python", {"code": "print(1)"}))
    (err,) = bad.calls
    assert isinstance(err, ToolCallError) and "literals" in err.message


def test_llama3_malformed_calls_become_errors():
    (bad_json,) = parse_llama3('{"name": "calculator", "parameters": {"expression": "2+').calls
    (bare_tag,) = parse_llama3("<|python_tag|>print(1)").calls
    assert isinstance(bad_json, ToolCallError) and "not valid JSON" in bad_json.message
    assert isinstance(bare_tag, ToolCallError)


def test_too_many_calls_in_one_turn_are_capped_with_an_error():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * (MAX_CALLS_PER_TURN + 3)
    calls = parse_hermes(text).calls
    assert len(calls) == MAX_CALLS_PER_TURN + 1 and isinstance(calls[-1], ToolCallError)


def test_unknown_parser_names_are_rejected_with_the_known_ones():
    with pytest.raises(ValueError, match="known: \\['hermes', 'llama3'\\]"):
        get_parser("mistral")


@pytest.mark.parametrize("parse, text, needle", [
    (parse_hermes, "<tool_call>" + "[" * 5000 + "</tool_call>", "nested too deep"),
    (parse_llama3, '{"name": "f", "parameters": ' + "[" * 5000, "nested too deep"),
    (parse_llama3, "[f(a={[1]: 2})]", "arguments must be literals"),
    (parse_llama3, "[f(a=" + "-" * 5000 + "1)]", "cannot be parsed"),
    (parse_llama3, "[f(**{'a': 1})]", "no **"),
    (parse_llama3, "[f(a=1, a=2)]", "distinct"),
])
def test_model_text_a_parser_cannot_take_is_a_call_error_not_an_exception(parse, text, needle):
    turn = parse(text)

    assert len(turn.calls) == 1 and isinstance(turn.calls[0], ToolCallError), turn.calls
    assert needle in turn.calls[0].message


def test_a_hermes_call_whose_json_string_holds_the_closing_tag_is_one_whole_call():
    code = "print('</tool_call>')"
    text = ('Run it.<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}'
            '\n</tool_call> done')

    turn = parse_hermes(text)

    assert turn.calls == (ToolCall("python", {"code": code}),)
    assert turn.content == "Run it. done"


@pytest.mark.parametrize("answer", ["[2, 5) U (6, 8]", "[1, 2, 3]", "[x (the root), 4]"])
def test_llama3_bracketed_text_that_is_no_call_list_is_content(answer):
    turn = parse_llama3(answer)

    assert turn.calls == () and turn.content == answer


def test_llama3_a_call_list_with_a_typo_is_still_a_call_error():
    (err,) = parse_llama3('[calculator(expression="2+2"]').calls
    assert isinstance(err, ToolCallError) and "not a list of calls" in err.message
