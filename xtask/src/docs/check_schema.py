"""The configuration schema's check (`cargo xtask docs`, `cargo xtask lint`).

Arguments: the schema, then configuration files as JSON. The schema must be a valid JSON Schema
(draft 2020-12), accept every configuration given, and refuse a file with an unknown field or an
unknown load-balancing policy (so a schema that accepts anything fails too).
"""

import json
import sys

try:
    from jsonschema import Draft202012Validator
except ImportError:
    sys.exit("python: no jsonschema in the venv; run `cargo xtask setup` (tests/xds/requirements.txt)")

schema_path, configs = sys.argv[1], sys.argv[2:]
with open(schema_path, encoding="utf-8") as f:
    schema = json.load(f)
Draft202012Validator.check_schema(schema)
validator = Draft202012Validator(schema)

failed = 0
for path in configs:
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    for error in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.path))):
        failed += 1
        where = "/".join(map(str, error.path)) or "."
        print(f"{path}: {where}: {error.message}", file=sys.stderr)

for name, wrong in [
    ("an unknown field", {"instance": "x", "no_such_field": 1}),
    ("an unknown lb_policy", {"clusters": [{"name": "a", "lb_policy": "NO_SUCH_POLICY"}]}),
]:
    if validator.is_valid(wrong):
        failed += 1
        print(f"{schema_path}: accepts a file with {name}", file=sys.stderr)

if failed:
    sys.exit(f"{schema_path}: {failed} problem(s)")
print(f"{schema_path}: a valid JSON Schema; accepts {len(configs)} configurations, refuses the wrong ones")
