// JSON Schema, JSON mode and regular expressions compiled to a Grammar.
//
// Output form: compact JSON with bounded whitespace: when
// `JsonFormat::whitespace` is set, one optional ' ' or '\n' may follow '{',
// '[', ',' and ':' and precede '}' and ']'; nowhere else. Object properties
// appear in the schema's `properties` order; required ones always, optional
// ones may be skipped. Strings are written with one spelling per character
// (char_set.h). So output length is bounded whenever the schema bounds
// string lengths, array sizes and recursion.
//
// Supported keywords: type (incl. type lists), properties, required,
// additionalProperties (false / true / schema; when absent and properties
// are listed no extra properties are produced, as in OpenAI strict mode;
// when absent without properties, any members), enum, const, anyOf,
// oneOf (generated like anyOf: exclusivity is not enforced), allOf with one
// member, items, minItems, maxItems, minLength, maxLength, pattern (anchored
// at both ends), format (date, time, date-time, email, uuid, ipv4, hostname:
// regular approximations, see json_schema.cc), minimum, maximum,
// exclusiveMinimum, exclusiveMaximum (integers: exact; numbers: see
// json_schema.cc), $ref to "#", "#/$defs/..." and "#/definitions/...",
// nullable (OpenAPI). Annotations (title, description, default, examples,
// $schema, $id, $comment, deprecated, readOnly, writeOnly) are ignored.
// Anything else is INVALID_ARGUMENT naming the keyword.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/language/grammar/grammar.h"

namespace vlm::grammar {

struct JsonFormat {
  bool whitespace = true;  // allow the single optional whitespace described above
  GrammarLimits limits;
};

// INVALID_ARGUMENT for text that is not JSON or a schema this compiler does
// not support (the message names the keyword and its JSON pointer);
// RESOURCE_EXHAUSTED when the grammar would exceed the limits.
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(absl::string_view schema_json,
                                                                 const JsonFormat& format = {});

// `prefix` + a JSON value valid under the schema + `suffix` (fixed text
// around it: a tool call's tags).
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchemaBetween(
    absl::string_view schema_json, absl::string_view prefix, absl::string_view suffix,
    const JsonFormat& format = {});

// JSON mode: any JSON value, or (object_only, OpenAI's json_object) any object.
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonMode(bool object_only,
                                                               const JsonFormat& format = {});

// The whole output matches `pattern` (regex.h).
absl::StatusOr<std::shared_ptr<const Grammar>> CompileRegex(absl::string_view pattern,
                                                            const GrammarLimits& limits = {});

}  // namespace vlm::grammar
