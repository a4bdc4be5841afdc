from reward_fns.json_schema import json_match, json_schema

SCHEMA = '{"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}'


def test_schema_reward_on_valid_invalid_and_malformed() -> None:
    completions = ['{"age": 3}', '{"age": "three"}', "{age: 3}", '```json\n{"age": 4}\n```', "[" * 10_000]
    assert json_schema(completions=completions, schema=[SCHEMA] * 5) == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_schema_reward_in_chat_format_and_dict_schema() -> None:
    chat = [[{"role": "assistant", "content": '{"age": 1}'}]]
    assert json_schema(completions=chat, schema=[{"type": "object", "required": ["age"]}]) == [1.0]


def test_missing_or_broken_schema_cannot_judge() -> None:
    assert json_schema(completions=['{"a": 1}', '{"a": 1}'], schema=[None, '{"type": 12}']) == [None, None]


def test_json_match_ignores_order_and_spacing_only() -> None:
    gold = ['{"a":[1,2],"b":null}'] * 3
    completions = ['{ "b": null, "a": [1, 2] }', '{"a": [2, 1], "b": null}', "nope"]
    assert json_match(completions=completions, ground_truth=gold) == [1.0, 0.0, 0.0]
    assert json_match(completions=["{}"], ground_truth=["{bad"]) == [None]
