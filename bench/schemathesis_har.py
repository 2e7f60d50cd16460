"""Every request of a schemathesis run (its HAR report) against the OpenAPI document it tested.

Schemathesis reports one failure of a kind per operation; this lists all of them:

- every 5xx;
- every response to a documented route whose status the document does not list for it;
- every JSON response whose body does not match the document's schema for its status;
- every request whose JSON body matches the route's request schema but was refused with a 4xx
  other than 401, 403, 404, 409 and 429 (which schemathesis accepts too), grouped by the error's
  message (digits folded), with the shortest example of each.

    python bench/schemathesis_har.py HAR.json OPENAPI.json

Exit status 1 when there is a 5xx, an undocumented status or a nonconforming response (refused
schema-valid requests are listed, not counted: some constraints span fields, or depend on the
model, and a JSON schema cannot say them).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from urllib.parse import urlsplit

from jsonschema import Draft202012Validator


# what schemathesis accepts for a schema-valid request too: auth, no such model, a full queue
EXPECTED_REFUSALS = {401, 403, 404, 409, 429}


def _template(paths: dict, path: str) -> str | None:
    for template in paths:
        pattern = "^" + re.sub(r"\{[^/]+\}", "[^/]+", re.escape(template).replace(r"\{", "{").replace(r"\}", "}")) + "$"
        if re.match(pattern, path):
            return template
    return None


def _validator(spec: dict, schema: dict) -> Draft202012Validator:
    return Draft202012Validator({**schema, "components": spec.get("components", {})})


def _header(headers: list[dict], name: str) -> str:
    return next((h["value"] for h in headers if h["name"].lower() == name), "")


def main(har_path: str, spec_path: str) -> int:
    with open(har_path, encoding="utf-8") as f:
        entries = json.load(f)["log"]["entries"]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    paths = spec["paths"]
    server_errors, undocumented, nonconforming = [], [], []
    refused: dict[tuple, list] = defaultdict(list)
    statuses: dict[tuple, int] = defaultdict(int)
    for entry in entries:
        req, res = entry["request"], entry["response"]
        method, path, status = req["method"].lower(), urlsplit(req["url"]).path, res["status"]
        template = _template(paths, path)
        operation = paths.get(template, {}).get(method) if template else None
        statuses[(method.upper(), template or path, status)] += 1
        if status >= 500:
            server_errors.append(entry)
        if operation is None:
            continue
        documented = operation.get("responses", {})
        if str(status) not in documented and "default" not in documented:
            undocumented.append(entry)
            continue
        text = res.get("content", {}).get("text") or ""
        media = res.get("content", {}).get("mimeType", "").split(";")[0].strip()
        schema = documented.get(str(status), {}).get("content", {}).get(media, {}).get("schema")
        if media == "application/json" and schema is not None:
            try:
                errors = list(_validator(spec, schema).iter_errors(json.loads(text)))
            except json.JSONDecodeError as exc:
                errors = [exc]
            if errors:
                nonconforming.append((entry, str(errors[0])[:300]))
        body_schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if (body_schema is None or not 400 <= status < 500 or status in EXPECTED_REFUSALS or "postData" not in req
                or not _header(req["headers"], "content-type").startswith("application/json")):
            continue
        try:
            body = json.loads(req["postData"]["text"])
        except json.JSONDecodeError:
            continue
        if not _validator(spec, body_schema).is_valid(body):
            continue
        try:
            message = json.loads(text)["error"]["message"]
        except (json.JSONDecodeError, KeyError, TypeError):
            message = text[:200]
        refused[(method.upper(), template, status, re.sub(r"\d+", "N", message))].append(req["postData"]["text"])

    print(f"{len(entries)} requests")
    for (method, path, status), count in sorted(statuses.items()):
        print(f"  {method:7} {path:28} {status}  x{count}")
    print(f"5xx: {len(server_errors)}")
    for entry in server_errors[:20]:
        print(f"  {entry['request']['method']} {entry['request']['url']} -> {entry['response']['status']}: "
              f"{entry['request'].get('postData', {}).get('text', '')[:300]}")
    print(f"statuses the document does not list: {len(undocumented)}")
    for entry in undocumented[:20]:
        print(f"  {entry['request']['method']} {entry['request']['url']} -> {entry['response']['status']}")
    print(f"responses not matching the document's schema: {len(nonconforming)}")
    for entry, error in nonconforming[:20]:
        print(f"  {entry['request']['method']} {entry['request']['url']} -> {entry['response']['status']}: {error}")
    print(f"schema-valid requests refused: {sum(map(len, refused.values()))} in {len(refused)} kinds")
    for (method, path, status, message), bodies in sorted(refused.items(), key=lambda kv: -len(kv[1])):
        example = min(bodies, key=len)
        print(f"  x{len(bodies):<4} {method} {path} {status}: {message}\n         e.g. {example[:400]}")
    return 1 if server_errors or undocumented or nonconforming else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
