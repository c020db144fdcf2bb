"""JSON schemas and regexes for structured outputs: tests/test_structured.py and
benchmarks/structured.py run them.

50 schemas of varied shape (flat and nested objects, arrays, enums, consts, patterns, formats,
bounded numbers, anyOf / oneOf, nullable fields, $defs and $ref, optional properties) and 20
regexes. Strings, arrays and numbers are bounded so that a small model's answer ends within a
small token budget (an unbounded string can run to max_tokens, and a cut JSON value is not JSON).
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 24}  # a short string
NAME = {"type": "string", "minLength": 1, "maxLength": 20}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SCORE = {"type": "number", "minimum": 0, "maximum": 10}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}


def obj(props: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    """An object schema; every property required unless said otherwise."""
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


SCHEMAS: list[tuple[str, str, dict]] = [
    # (name, prompt, schema)
    ("person", "Give a person's name and age.", obj({"name": NAME, "age": AGE})),
    ("city", "Name a city and its country.", obj({"city": NAME, "country": NAME})),
    ("book", "Describe a book: title, author, year.",
     obj({"title": S, "author": NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("flag", "Is the sky blue? Answer in JSON.", obj({"answer": {"type": "boolean"}})),
    ("color_enum", "Pick a primary color.", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("const", "Confirm the status.", obj({"status": {"const": "ok"}, "code": {"type": "integer", "minimum": 100,
                                                                               "maximum": 599}})),
    ("rating", "Rate the movie Inception from 0 to 10.", obj({"movie": S, "score": SCORE})),
    ("tags", "Give three tags for a blog post about cooking.", obj({"tags": TAGS})),
    ("numbers", "List up to four small prime numbers.",
     obj({"primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 97}, "maxItems": 4}})),
    ("nested_address", "Give an address for a fictional person.",
     obj({"name": NAME, "address": obj({"street": S, "city": NAME, "zip": {"type": "string",
                                                                            "pattern": "^[0-9]{5}$"}})})),
    ("nested_deep", "Describe a company with its CEO and the CEO's contact.",
     obj({"company": NAME, "ceo": obj({"name": NAME, "contact": obj({"email": {"type": "string", "maxLength": 30,
                                                                                 "pattern": "^[a-z]+@[a-z]+\\.com$"}})})})),
    ("pattern_phone", "Give a US phone number.",
     obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}})),
    ("pattern_code", "Make up a product code.",
     obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}})),
    ("date_format", "When did the first moon landing happen?", obj({"event": S, "date": {"type": "string",
                                                                                         "format": "date"}})),
    ("anyof_scalar", "Give a value that is a number or a word.",
     obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000}, S]}})),
    ("anyof_objects", "Describe a pet: a dog or a fish.",
     obj({"pet": {"anyOf": [obj({"kind": {"const": "dog"}, "barks": {"type": "boolean"}}),
                            obj({"kind": {"const": "fish"}, "fins": {"type": "integer", "minimum": 0,
                                                                       "maximum": 8}})]}})),
    ("nullable_type", "Give a person's middle name, or null if none.",
     obj({"first": NAME, "middle": {"type": ["string", "null"], "maxLength": 20}})),
    ("nullable_anyof", "Give the population of Atlantis, or null if unknown.",
     obj({"place": NAME, "population": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10 ** 9},
                                                  {"type": "null"}]}})),
    ("optional_props", "Describe a car; the color is optional.",
     obj({"make": NAME, "model": NAME, "color": NAME}, required=["make", "model"])),
    ("array_of_objects", "List two fruits with their colors.",
     obj({"fruits": {"type": "array", "items": obj({"name": NAME, "color": NAME}), "minItems": 1,
                     "maxItems": 2}})),
    ("matrix", "Give a 2x2 matrix of small integers.",
     obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                   "items": {"type": "array", "minItems": 2, "maxItems": 2,
                             "items": {"type": "integer", "minimum": -9, "maximum": 9}}}})),
    ("refs", "Describe two points on a plane.",
     {"$defs": {"point": obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                              "y": {"type": "integer", "minimum": -100, "maximum": 100}})},
      **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})}),
    ("oneof", "Give a shape: a circle with a radius or a square with a side.",
     obj({"shape": {"oneOf": [obj({"circle": {"type": "number", "minimum": 0, "maximum": 100}}),
                              obj({"square": {"type": "number", "minimum": 0, "maximum": 100}})]}})),
    ("weather", "What's the weather in Paris?",
     obj({"city": NAME, "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
          "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    ("recipe", "Give a simple recipe.",
     obj({"name": S, "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1,
                                     "maxItems": 3}, "minutes": {"type": "integer", "minimum": 1, "maximum": 240}})),
    ("user_profile", "Create a user profile.",
     obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"}, "age": AGE,
          "verified": {"type": "boolean"}})),
    ("order", "Create an order with one item.",
     obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
          "items": {"type": "array", "minItems": 1, "maxItems": 2,
                    "items": obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                  "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("event", "Describe a meeting.",
     obj({"title": S, "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
          "hour": {"type": "integer", "minimum": 0, "maximum": 23}})),
    ("translation", "Translate 'hello' to French.", obj({"source": S, "target": S, "language": NAME})),
    ("sentiment", "What is the sentiment of 'I love this!'?",
     obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
          "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("classification", "Classify the animal 'whale'.",
     obj({"animal": NAME, "class": {"enum": ["mammal", "bird", "fish", "reptile", "amphibian"]}})),
    ("coordinates", "Give the coordinates of London.",
     obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
          "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("version", "Give a software version.",
     obj({"name": NAME, "version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}})),
    ("rgb", "Give an RGB color.",
     obj({"r": {"type": "integer", "minimum": 0, "maximum": 255}, "g": {"type": "integer", "minimum": 0,
                                                                       "maximum": 255},
          "b": {"type": "integer", "minimum": 0, "maximum": 255}})),
    ("exclusive_bounds", "Give a probability strictly between 0 and 1.",
     obj({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}})),
    ("multiple_of", "Give an even number of eggs up to 24.",
     obj({"eggs": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 24}})),
    ("string_lengths", "Give a three-letter airport code and a short city name.",
     obj({"iata": {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]+$"}, "city": NAME})),
    ("array_bounds", "Give exactly two hobbies.",
     obj({"hobbies": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 2}})),
    ("enum_mixed", "Pick a priority.", obj({"priority": {"enum": [1, 2, 3, "urgent", None]}})),
    ("open_object", "Give a person's name and anything else you know.",
     {"type": "object", "properties": {"name": NAME}, "required": ["name"], "maxProperties": 2,
      "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99}}),
    ("top_array", "List up to three colors.", {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}),
    ("top_enum", "Answer yes or no: is water wet?", {"enum": ["yes", "no"]}),
    ("top_integer", "How many legs does a spider have?", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("top_string", "Say a greeting.", {"type": "string", "minLength": 1, "maxLength": 30}),
    ("tuple_prefix", "Give a name and an age as a pair.",
     {"type": "array", "prefixItems": [NAME, AGE], "items": False, "minItems": 2}),
    ("inventory", "Describe a warehouse inventory with two products.",
     obj({"warehouse": NAME, "products": {"type": "array", "minItems": 1, "maxItems": 2,
                                          "items": obj({"name": NAME, "stock": {"type": "integer", "minimum": 0,
                                                                                "maximum": 999},
                                                        "price": {"type": "number", "minimum": 0,
                                                                  "maximum": 999}})}})),
    ("tree", "Describe a small family tree: a parent with children.",
     obj({"parent": NAME, "children": {"type": "array", "maxItems": 2,
                                       "items": obj({"name": NAME, "age": AGE})}})),
    ("settings", "Give app settings.",
     obj({"theme": {"enum": ["light", "dark"]}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
          "notifications": obj({"email": {"type": "boolean"}, "push": {"type": "boolean"}})})),
    ("api_error", "Describe an HTTP error.",
     obj({"error": obj({"code": {"type": "integer", "minimum": 400, "maximum": 599}, "message": S,
                        "retry": {"type": ["boolean", "null"]}})})),
    ("time_format", "What time is breakfast?", obj({"meal": NAME, "time": {"type": "string",
                                                                           "pattern": "^[0-2][0-9]:[0-5][0-9]$"}})),
]

REGEXES: list[tuple[str, str, str]] = [
    # (name, prompt, regex): ASCII classes only, so Python's re and llguidance's regex agree
    ("phone", "Give a US phone number.", r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("date", "What is today's date?", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("time", "What time is it?", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("email", "Give an email address.", r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"),
    ("ipv4", "Give an IP address.", r"((25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})"),
    ("hex_color", "Give a color in hex.", r"#[0-9a-f]{6}"),
    ("yes_no", "Is the Earth round?", r"(yes|no)"),
    ("integer", "How many days are in a week?", r"-?[0-9]{1,6}"),
    ("decimal", "What is pi?", r"[0-9]{1,3}\.[0-9]{1,4}"),
    ("word", "Name a fruit in one word.", r"[A-Za-z]{2,12}"),
    ("two_words", "Name a famous person.", r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,12}"),
    ("zip", "Give a US zip code.", r"[0-9]{5}(-[0-9]{4})?"),
    ("uuid_like", "Give an identifier.", r"[0-9a-f]{8}-[0-9a-f]{4}"),
    ("grade", "What grade did you get?", r"[A-F][+-]?"),
    ("version", "Which version is it?", r"v[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}"),
    ("money", "How much does a coffee cost?", r"\$[0-9]{1,3}\.[0-9]{2}"),
    ("percent", "What is the chance of rain?", r"(100|[0-9]{1,2})%"),
    ("csv_row", "List three numbers separated by commas.", r"[0-9]{1,3},[0-9]{1,3},[0-9]{1,3}"),
    ("sentence", "Say something short.", r"[A-Z][a-z ,]{2,40}[.!?]"),
    ("key_value", "Give a setting as key=value.", r"[a-z_]{1,12}=[a-z0-9]{1,12}"),
]


def cases(suffix: str = " Answer in JSON.") -> list[tuple[str, str, str, object]]:
    """(kind, name, prompt, schema or regex): the schemas (their prompts ask for JSON), then the regexes."""
    return ([("json", n, p + suffix, s) for n, p, s in SCHEMAS]
            + [("regex", n, p, r) for n, p, r in REGEXES])


def valid(kind: str, value, text: str) -> bool:
    """Whether ``text`` matches: a JSON document valid under the schema (formats checked), or a
    full match of the regex."""
    import json
    import re

    import jsonschema

    if kind == "regex":
        return re.fullmatch(value, text) is not None
    try:
        jsonschema.validate(json.loads(text), value, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_cases(engine, lltok, todo, params, constrained: bool = True) -> list[tuple[list[int], str]]:
    """Submit every case to the engine at once (it runs --max-num-seqs of them together), each with
    its grammar (or none); returns each one's (tokens, finish reason)."""
    from dataclasses import replace

    from specserve.engine.constraint import ConstraintSpec
    from specserve.models.chat_template import ChatTemplate
    from specserve.server.structured import compile_grammar, grammar_source

    tok = engine.tokenizer
    template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
    rids = []
    for i, (kind, _name, prompt, value) in enumerate(todo):
        p = params
        if constrained:
            grammar = compile_grammar(lltok, grammar_source(kind, value).grammar)
            if isinstance(grammar, str):
                raise ValueError(f"case {_name}: {grammar}")
            p = replace(params, structured=ConstraintSpec(grammar))
        rid = f"case-{i}-{id(todo)}"
        engine.add_request(rid, tok.encode(template.render([{"role": "user", "content": prompt}])), p)
        rids.append(rid)
    got: dict[str, list[int]] = {r: [] for r in rids}
    finish: dict[str, str] = {}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return [(got[r], finish[r]) for r in rids]
