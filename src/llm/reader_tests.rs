//! The usage reader against bodies as providers send them, whole, byte by byte and split at
//! every boundary, and against hostile ones.

use super::*;

const COUNT_MAX: u64 = 1 << 53;

/// The outcome and events of `body` fed in `chunks`.
fn read_chunks(framing: Framing, shapes: Shapes, chunks: &[&[u8]]) -> (Outcome, u64, bool) {
    let mut reader = Reader::new(framing, shapes);
    for chunk in chunks {
        reader.feed(chunk);
    }
    let outcome = reader.finish(true);
    assert_eq!(reader.finish(true), outcome, "finish again");
    (outcome, reader.events(), reader.shaped())
}

/// What `body` reads to, after checking that whole, byte by byte and split in two at every
/// boundary it reads the same, with the same events.
fn read(framing: Framing, shapes: Shapes, body: &[u8]) -> (Outcome, u64) {
    let whole = read_chunks(framing, shapes, &[body]);
    let bytes: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(read_chunks(framing, shapes, &bytes), whole, "byte by byte");
    for at in 0..=body.len() {
        let (a, b) = body.split_at(at);
        assert_eq!(
            read_chunks(framing, shapes, &[a, b]),
            whole,
            "split at {at}: {:?} | {:?}",
            String::from_utf8_lossy(&a[a.len().saturating_sub(20)..]),
            String::from_utf8_lossy(&b[..b.len().min(20)])
        );
    }
    (whole.0, whole.1)
}

fn usage(outcome: Outcome) -> (Tokens, Option<String>) {
    match outcome {
        Outcome::Read(usage) => (usage.tokens, usage.model.map(|m| m.to_string())),
        other => panic!("not read: {other:?}"),
    }
}

fn tokens(input: u64, output: u64, cache_read: u64, cache_write: u64, reasoning: u64) -> Tokens {
    Tokens {
        input,
        output,
        cache_read,
        cache_write,
        reasoning,
    }
}

fn unreadable(outcome: Outcome) -> Reason {
    match outcome {
        Outcome::Unreadable { reason, .. } => reason,
        other => panic!("read: {other:?}"),
    }
}

fn json(shapes: Shapes, body: &str) -> Outcome {
    read(Framing::Json, shapes, body.as_bytes()).0
}

/// Whole and in two pieces only, for bodies too long to split everywhere in a debug build.
fn json_quick(body: &[u8]) -> Outcome {
    let whole = read_chunks(Framing::Json, Shapes::All, &[body]).0;
    let (a, b) = body.split_at(body.len() / 2);
    assert_eq!(read_chunks(Framing::Json, Shapes::All, &[a, b]).0, whole);
    whole
}

const OPENAI_CHAT: &str = r#"{
  "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
  "object": "chat.completion",
  "created": 1741570283,
  "model": "o4-mini-2025-04-16",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "The answer is \"42\" \u2014 see \\ below.\n",
        "refusal": null,
        "annotations": [],
        "usage": {"prompt_tokens": 999999}
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 1117,
    "completion_tokens": 238,
    "total_tokens": 1355,
    "prompt_tokens_details": {
      "cached_tokens": 1024,
      "audio_tokens": 0
    },
    "completion_tokens_details": {
      "reasoning_tokens": 192,
      "audio_tokens": 0,
      "accepted_prediction_tokens": 0,
      "rejected_prediction_tokens": 0
    }
  },
  "service_tier": "default",
  "system_fingerprint": null
}
"#;

#[test]
fn openai_chat_completion_json() {
    let (outcome, events) = read(Framing::Json, Shapes::OpenAi, OPENAI_CHAT.as_bytes());
    let (tokens_read, model) = usage(outcome);
    assert_eq!(tokens_read, tokens(1117, 238, 1024, 0, 192));
    assert_eq!(model.as_deref(), Some("o4-mini-2025-04-16"));
    assert_eq!(events, 1);
    assert_eq!(json(Shapes::All, OPENAI_CHAT), outcome);
}

fn chat_chunk(rest: &str) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-AyPVNpMWwNQMXDvTr3e4rfCQ0Rezd\",\"object\":\"chat.completion.chunk\",\
         \"created\":1738960997,\"model\":\"gpt-4o-mini-2024-07-18\",\"service_tier\":\"default\",\
         \"system_fingerprint\":\"fp_72ed7ab54c\",{rest}}}\n\n"
    )
}

fn openai_stream(include_usage: bool) -> String {
    let usage_null = if include_usage { ",\"usage\":null" } else { "" };
    let mut body = String::new();
    for delta in [
        r#"{"role":"assistant","content":"","refusal":null}"#,
        r#"{"content":"Hello"}"#,
        r#"{"content":"! How can I help?"}"#,
    ] {
        body += &chat_chunk(&format!(
            r#""choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":null}}]{usage_null}"#
        ));
    }
    body += &chat_chunk(&format!(
        r#""choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"stop"}}]{usage_null}"#
    ));
    if include_usage {
        body += &chat_chunk(
            r#""choices":[],"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}"#,
        );
    }
    body + "data: [DONE]\n\n"
}

#[test]
fn openai_chat_stream_with_include_usage() {
    let body = openai_stream(true);
    let (outcome, events) = read(Framing::Sse, Shapes::OpenAi, body.as_bytes());
    let (tokens_read, model) = usage(outcome);
    assert_eq!(tokens_read, tokens(19, 10, 0, 0, 0));
    assert_eq!(model.as_deref(), Some("gpt-4o-mini-2024-07-18"));
    assert_eq!(events, 6, "five chunks and [DONE]");
}

#[test]
fn openai_chat_stream_without_include_usage_has_none() {
    let body = openai_stream(false);
    let (outcome, events) = read(Framing::Sse, Shapes::All, body.as_bytes());
    assert_eq!(
        outcome,
        Outcome::Unreadable {
            reason: Reason::NoUsage,
            model: Model::new(b"gpt-4o-mini-2024-07-18"),
        }
    );
    assert_eq!(events, 5);
    let mut reader = Reader::new(Framing::Sse, Shapes::All);
    reader.feed(body.as_bytes());
    assert!(!reader.shaped());
}

const RESPONSES_JSON: &str = r#"{
  "id": "resp_67ccd3a9da748190baa7f1570fe91ac604becb25c45c1d41",
  "object": "response",
  "created_at": 1741476777,
  "status": "completed",
  "error": null,
  "incomplete_details": null,
  "instructions": null,
  "max_output_tokens": null,
  "model": "gpt-4.1-2025-04-14",
  "output": [
    {
      "type": "message",
      "id": "msg_67ccd3acc8d48190a77525dc6de64b4104becb25c45c1d41",
      "status": "completed",
      "role": "assistant",
      "content": [
        {
          "type": "output_text",
          "text": "The image depicts a scenic landscape with a wooden boardwalk.",
          "annotations": []
        }
      ]
    }
  ],
  "parallel_tool_calls": true,
  "previous_response_id": null,
  "reasoning": {"effort": null, "summary": null},
  "store": true,
  "temperature": 1.0,
  "text": {"format": {"type": "text"}},
  "tool_choice": "auto",
  "tools": [],
  "top_p": 1.0,
  "truncation": "disabled",
  "usage": {
    "input_tokens": 328,
    "input_tokens_details": {"cached_tokens": 256},
    "output_tokens": 52,
    "output_tokens_details": {"reasoning_tokens": 12},
    "total_tokens": 380
  },
  "user": null,
  "metadata": {}
}"#;

#[test]
fn openai_responses_json() {
    let (tokens_read, model) = usage(json(Shapes::OpenAi, RESPONSES_JSON));
    assert_eq!(tokens_read, tokens(328, 52, 256, 0, 12));
    assert_eq!(model.as_deref(), Some("gpt-4.1-2025-04-14"));
}

fn responses_event(kind: &str, rest: &str) -> String {
    format!("event: {kind}\ndata: {{\"type\":\"{kind}\",{rest}}}\n\n")
}

fn responses_stream() -> String {
    let response = |status: &str, usage: &str| {
        format!(
            r#""response":{{"id":"resp_67c9fdcecf488190bdd9a0409de3a1ec07b8b0ad4e5eb654","object":"response","created_at":1741290958,"status":"{status}","error":null,"model":"gpt-4.1-2025-04-14","output":[],"temperature":1.0,"tools":[],"usage":{usage},"metadata":{{}}}}"#
        )
    };
    let mut body = responses_event(
        "response.created",
        &format!(r#""sequence_number":0,{}"#, response("in_progress", "null")),
    );
    body += &responses_event(
        "response.in_progress",
        &format!(r#""sequence_number":1,{}"#, response("in_progress", "null")),
    );
    body += &responses_event(
        "response.output_text.delta",
        r##""sequence_number":4,"item_id":"msg_67c9fdcf37fc8190ba82116e33fb28c507b8b0ad4e5eb654","output_index":0,"content_index":0,"delta":"Hi""##,
    );
    body += &responses_event(
        "response.completed",
        &format!(
            r#""sequence_number":8,{}"#,
            response(
                "completed",
                r#"{"input_tokens":37,"input_tokens_details":{"cached_tokens":0},"output_tokens":11,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":48}"#
            )
        ),
    );
    body
}

#[test]
fn openai_responses_stream() {
    let (outcome, events) = read(Framing::Sse, Shapes::OpenAi, responses_stream().as_bytes());
    let (tokens_read, model) = usage(outcome);
    assert_eq!(tokens_read, tokens(37, 11, 0, 0, 0));
    assert_eq!(model.as_deref(), Some("gpt-4.1-2025-04-14"));
    assert_eq!(events, 4);
}

const ANTHROPIC_JSON: &str = r#"{"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","type":"message","role":"assistant","model":"claude-sonnet-4-20250514","content":[{"type":"text","text":"Hi! My name is Claude."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":2095,"cache_creation_input_tokens":1800,"cache_read_input_tokens":100,"cache_creation":{"ephemeral_5m_input_tokens":1800,"ephemeral_1h_input_tokens":0},"output_tokens":503,"service_tier":"standard"}}"#;

#[test]
fn anthropic_json() {
    let (tokens_read, model) = usage(json(Shapes::Anthropic, ANTHROPIC_JSON));
    assert_eq!(tokens_read, tokens(2095 + 1800 + 100, 503, 100, 1800, 0));
    assert_eq!(model.as_deref(), Some("claude-sonnet-4-20250514"));
}

fn anthropic_stream() -> String {
    let event = |kind: &str, data: &str| format!("event: {kind}\ndata: {data}\n\n");
    let mut body = event(
        "message_start",
        r#"{"type":"message_start","message":{"id":"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-20250514","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,"cache_creation_input_tokens":10,"cache_read_input_tokens":5,"output_tokens":1}}}"#,
    );
    body += &event(
        "content_block_start",
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    body += &event("ping", r#"{"type": "ping"}"#);
    for (text, output) in [("Hello", 5), ("! I am", 17), (" Claude.", 42)] {
        body += &event(
            "content_block_delta",
            &format!(
                r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{text}"}}}}"#
            ),
        );
        body += &event(
            "message_delta",
            &format!(
                r#"{{"type":"message_delta","delta":{{"stop_reason":null,"stop_sequence":null}},"usage":{{"output_tokens":{output}}}}}"#
            ),
        );
    }
    body += &event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#);
    body + &event("message_stop", r#"{"type":"message_stop"}"#)
}

#[test]
fn anthropic_stream_counts_are_cumulative() {
    let (outcome, events) = read(Framing::Sse, Shapes::Anthropic, anthropic_stream().as_bytes());
    let (tokens_read, model) = usage(outcome);
    assert_eq!(tokens_read, tokens(40, 42, 5, 10, 0), "42, never 64");
    assert_eq!(model.as_deref(), Some("claude-sonnet-4-20250514"));
    assert_eq!(events, 11);
}

const GEMINI_JSON: &str = r#"{
  "candidates": [
    {
      "content": {
        "parts": [
          {
            "text": "AI learns patterns from data to make predictions."
          }
        ],
        "role": "model"
      },
      "finishReason": "STOP",
      "index": 0
    }
  ],
  "usageMetadata": {
    "promptTokenCount": 4108,
    "candidatesTokenCount": 9,
    "totalTokenCount": 4424,
    "cachedContentTokenCount": 4096,
    "promptTokensDetails": [
      {
        "modality": "TEXT",
        "tokenCount": 4108
      }
    ],
    "thoughtsTokenCount": 307
  },
  "modelVersion": "gemini-2.5-flash",
  "responseId": "Hb2HaLvIFa-dz7IPz8ra0AM"
}
"#;

#[test]
fn gemini_json() {
    let (tokens_read, model) = usage(json(Shapes::Gemini, GEMINI_JSON));
    assert_eq!(tokens_read, tokens(4108, 9 + 307, 4096, 0, 307));
    assert_eq!(model.as_deref(), Some("gemini-2.5-flash"));
}

fn gemini_chunk(text: &str, usage: &str) -> String {
    format!(
        r#"{{"candidates": [{{"content": {{"parts": [{{"text": "{text}"}}],"role": "model"}}{finish}}}],"usageMetadata": {{{usage}}},"modelVersion": "gemini-2.5-flash-lite","responseId": "8cK5aOa3LMaZ1dkP0Y6F2Ak"}}"#,
        finish = if text.ends_with('.') {
            r#","finishReason": "STOP""#
        } else {
            ""
        }
    )
}

fn gemini_chunks() -> [String; 3] {
    [
        gemini_chunk(
            "The",
            r#""promptTokenCount": 6,"totalTokenCount": 7,"promptTokensDetails": [{"modality": "TEXT","tokenCount": 6}]"#,
        ),
        gemini_chunk(
            " sky is blue because",
            r#""promptTokenCount": 6,"candidatesTokenCount": 4,"totalTokenCount": 10"#,
        ),
        gemini_chunk(
            " of Rayleigh scattering.",
            r#""promptTokenCount": 6,"candidatesTokenCount": 12,"totalTokenCount": 40,"thoughtsTokenCount": 22"#,
        ),
    ]
}

#[test]
fn gemini_sse() {
    // As `alt=sse` sends it: CRLF line ends.
    let body: String = gemini_chunks()
        .iter()
        .map(|c| format!("data: {c}\r\n\r\n"))
        .collect();
    let (outcome, events) = read(Framing::Sse, Shapes::Gemini, body.as_bytes());
    let (tokens_read, model) = usage(outcome);
    assert_eq!(tokens_read, tokens(6, 34, 0, 0, 22));
    assert_eq!(model.as_deref(), Some("gemini-2.5-flash-lite"));
    assert_eq!(events, 3);
}

#[test]
fn gemini_streamed_json_array() {
    let body = format!("[{}]", gemini_chunks().join("\n,\r\n"));
    let (outcome, events) = read(Framing::Json, Shapes::Gemini, body.as_bytes());
    let (tokens_read, _) = usage(outcome);
    assert_eq!(tokens_read, tokens(6, 34, 0, 0, 22));
    assert_eq!(events, 3, "one per element");
    // Each element commits as it closes: a cut after the second reads what it said.
    let cut = body.find(",\r\n{").unwrap() + 3;
    let cut = body[cut..].find(",\r\n{").unwrap() + cut;
    let mut reader = Reader::new(Framing::Json, Shapes::Gemini);
    reader.feed(&body.as_bytes()[..cut]);
    assert_eq!(reader.events(), 2);
    let (tokens_read, _) = usage(reader.finish(false));
    assert_eq!(tokens_read, tokens(6, 4, 0, 0, 0));
}

#[test]
fn gemini_model_version_is_preferred_to_model() {
    let body = r#"{"modelVersion":"gemini-2.5-pro","model":"other","usageMetadata":{"promptTokenCount":1}}"#;
    assert_eq!(
        usage(json(Shapes::Gemini, body)).1.as_deref(),
        Some("gemini-2.5-pro")
    );
    let body = r#"{"model":"other","modelVersion":"gemini-2.5-pro","usageMetadata":{"promptTokenCount":1}}"#;
    assert_eq!(
        usage(json(Shapes::Gemini, body)).1.as_deref(),
        Some("gemini-2.5-pro")
    );
    let body = r#"{"model":"tuned-x","usageMetadata":{"promptTokenCount":1}}"#;
    assert_eq!(usage(json(Shapes::Gemini, body)).1.as_deref(), Some("tuned-x"));
}

#[test]
fn named_shapes_ignore_other_shapes_fields() {
    assert_eq!(unreadable(json(Shapes::Gemini, OPENAI_CHAT)), Reason::NoUsage);
    assert_eq!(unreadable(json(Shapes::OpenAi, GEMINI_JSON)), Reason::NoUsage);
    // Anthropic reads input/output but not OpenAI's details or prompt_tokens.
    let (tokens_read, _) = usage(json(Shapes::Anthropic, RESPONSES_JSON));
    assert_eq!(tokens_read, tokens(328, 52, 0, 0, 0));
    assert_eq!(unreadable(json(Shapes::Anthropic, OPENAI_CHAT)), Reason::NoUsage);
    // OpenAI does not read Anthropic's cache fields.
    let (tokens_read, _) = usage(json(Shapes::OpenAi, ANTHROPIC_JSON));
    assert_eq!(tokens_read, tokens(2095, 503, 0, 0, 0));
    // Nor a named shape's counts that are not its own, even invalid ones.
    let body = r#"{"usage":{"prompt_tokens":"12","input_tokens":3}}"#;
    assert_eq!(usage(json(Shapes::Anthropic, body)).0.input, 3);
    assert_eq!(unreadable(json(Shapes::OpenAi, body)), Reason::InvalidValue);
}

#[test]
fn mixed_shapes_add_up() {
    let body = r#"{"usage":{"prompt_tokens":10,"completion_tokens":1},"usageMetadata":{"promptTokenCount":5,"candidatesTokenCount":2}}"#;
    assert_eq!(usage(json(Shapes::All, body)).0, tokens(15, 3, 0, 0, 0));
    assert_eq!(usage(json(Shapes::Gemini, body)).0, tokens(5, 2, 0, 0, 0));
}

#[test]
fn keys_at_the_wrong_path_do_not_count() {
    for body in [
        r#"{"choices":[{"usage":{"prompt_tokens":5,"completion_tokens":1}}]}"#,
        r#"{"data":{"usage":{"prompt_tokens":5,"completion_tokens":1}}}"#,
        r#"{"usage":{"usage":{"prompt_tokens":5}},"x":{"prompt_tokens":1}}"#,
        r#"{"prompt_tokens":5,"completion_tokens":1}"#,
        r#"{"usage":{"prompt_tokens_details":{"prompt_tokens":5}}}"#,
        r#"[[{"usage":{"prompt_tokens":5}}]]"#,
        r#"{"message":{"message":{"usage":{"input_tokens":5}}}}"#,
        r#"{"usage":{"Prompt_tokens":5,"prompt_token":1,"prompt_tokenss":1}}"#,
        r#"{"usage":{"prompt\u005ftokens":5}}"#,
    ] {
        assert_eq!(unreadable(json(Shapes::All, body)), Reason::NoUsage, "{body}");
    }
    // A known object's keys after an unknown sibling object are still read.
    let body = r#"{"message":{"content":[{"usage":{"input_tokens":9}}],"usage":{"input_tokens":3},"model":"claude-x"}}"#;
    let (tokens_read, model) = usage(json(Shapes::Anthropic, body));
    assert_eq!(tokens_read.input, 3);
    assert_eq!(model.as_deref(), Some("claude-x"));
    // `usage` inside `message` returns to `message`, not to the root: `message.model` is read
    // as Anthropic's, which Shapes::OpenAi does not read.
    let body = r#"{"message":{"usage":{"input_tokens":3},"model":"claude-x"}}"#;
    assert_eq!(usage(json(Shapes::OpenAi, body)).1, None);
}

#[test]
fn null_counts_are_absent() {
    let body = r#"{"usage":{"prompt_tokens":null,"completion_tokens":4,"prompt_tokens_details":null}}"#;
    assert_eq!(usage(json(Shapes::All, body)).0, tokens(0, 4, 0, 0, 0));
    let body = r#"{"usage":{"prompt_tokens":null}}"#;
    assert_eq!(unreadable(json(Shapes::All, body)), Reason::NoUsage);
    // A later null does not erase an earlier value.
    let body = "data: {\"usage\":{\"input_tokens\":7}}\n\ndata: {\"usage\":{\"input_tokens\":null}}\n\n";
    assert_eq!(
        usage(read(Framing::Sse, Shapes::Anthropic, body.as_bytes()).0).0,
        tokens(7, 0, 0, 0, 0)
    );
}

#[test]
fn details_alone_are_not_usage() {
    let body = r#"{"usage":{"prompt_tokens_details":{"cached_tokens":5}}}"#;
    assert_eq!(unreadable(json(Shapes::All, body)), Reason::NoUsage);
}

#[test]
fn invalid_counts_give_up() {
    for value in [
        "-5",
        "1e309",
        "3.5",
        "\"12\"",
        "true",
        "false",
        "{}",
        "[1]",
        "9007199254740993",
        "1E3",
        "0.0",
        "-0",
    ] {
        let body = format!(r#"{{"usage":{{"prompt_tokens":{value},"completion_tokens":1}}}}"#);
        let outcome = json(Shapes::OpenAi, &body);
        assert_eq!(unreadable(outcome), Reason::InvalidValue, "{value}");
    }
    let body = r#"{"usage":{"prompt_tokens":9007199254740992,"completion_tokens":0}}"#;
    assert_eq!(usage(json(Shapes::OpenAi, body)).0.input, COUNT_MAX);
    // Elsewhere, such numbers are just JSON.
    let body = r#"{"x":[-5,1e309,3.5,-0.25E-7,0],"usage":{"prompt_tokens":1}}"#;
    assert_eq!(usage(json(Shapes::OpenAi, body)).0.input, 1);
    // An invalid count gives up a whole stream, whatever came before.
    let body = "data: {\"usage\":{\"input_tokens\":7}}\n\ndata: {\"usage\":{\"output_tokens\":-1}}\n\n";
    assert_eq!(
        unreadable(read(Framing::Sse, Shapes::All, body.as_bytes()).0),
        Reason::InvalidValue
    );
}

#[test]
fn malformed_json_gives_up() {
    for body in [
        "",
        "   ",
        "<html>502 Bad Gateway</html>",
        r#"{"usage":{"prompt_tokens":1}"#,
        r#"{"usage":{"prompt_tokens":1}}}"#,
        r#"{"usage":{"prompt_tokens":1}} x"#,
        r#"{"usage":{"prompt_tokens":1}}{}"#,
        r#"{"usage":{"prompt_tokens":1,}}"#,
        r#"{"usage":{"prompt_tokens" 1}}"#,
        r#"{"usage":{"prompt_tokens":01}}"#,
        r#"{"usage":{"prompt_tokens":1},"a":tru}"#,
        r#"{"usage":{"prompt_tokens":1},"a":"\x"}"#,
        r#"{"usage":{"prompt_tokens":1},"a":"\u12G4"}"#,
        r#"{"usage":{"prompt_tokens":1},"a":[1,]}"#,
        r#"{"usage":{"prompt_tokens":1},"a":[}"#,
        r#"{"usage":{"prompt_tokens":1},"a":1.}"#,
        r#"{"usage":{"prompt_tokens":1},"a":-}"#,
        r#"{"usage":{"prompt_tokens":1},"a":1e}"#,
        r#"{"usage":{"prompt_tokens":1},'a':1}"#,
        r#"[{"usage":{"prompt_tokens":1}},"#,
        r#"{"usage":{"prompt_tokens":1},"model":"gpt"#,
    ] {
        let outcome = json(Shapes::All, body);
        assert_eq!(unreadable(outcome), Reason::Malformed, "{body:?}");
    }
    // The model read before a give-up is still told.
    let body = r#"{"model":"gpt-4o","usage":{"prompt_tokens":1}}}"#;
    assert_eq!(
        json(Shapes::OpenAi, body),
        Outcome::Unreadable {
            reason: Reason::Malformed,
            model: Model::new(b"gpt-4o"),
        }
    );
    // Scalars and whitespace are JSON with nothing to read.
    for body in ["5", " 0 ", "null", "\"x\"", "[]", "{}", "[1,{}]"] {
        assert_eq!(unreadable(json(Shapes::All, body)), Reason::NoUsage, "{body}");
    }
}

#[test]
fn strings_are_skipped_whatever_they_hold() {
    let body =
        br#"{"choices":[{"text":"a\\\"b \"usage\": {\"prompt_tokens\": 5} \u00e9\ud83d\ude00 \\"}],"x":"#;
    let mut body = body.to_vec();
    body.extend_from_slice(b"\"\xff\xfe\xc3\x28 not UTF-8 \x80\",\"usage\":{\"input_tokens\":8}}");
    let (outcome, _) = read(Framing::Json, Shapes::All, &body);
    assert_eq!(usage(outcome).0.input, 8);
    // A long string of escapes, quotes and backslashes.
    let mut body = br#"{"content":""#.to_vec();
    for _ in 0..20_000 {
        body.extend_from_slice(br#"a\\\"b\\\\\"\u0041 "#);
    }
    body.extend_from_slice(br#"","usage":{"output_tokens":3}}"#);
    assert_eq!(usage(json_quick(&body)).0.output, 3);
}

#[test]
fn models_too_long_or_escaped_are_not_taken() {
    let long = "m".repeat(MODEL_MAX + 1);
    let body = format!(r#"{{"model":"{long}","usage":{{"prompt_tokens":1}}}}"#);
    assert_eq!(usage(json(Shapes::OpenAi, &body)).1, None);
    let longest = "m".repeat(MODEL_MAX);
    let body = format!(r#"{{"model":"{longest}","usage":{{"prompt_tokens":1}}}}"#);
    assert_eq!(usage(json(Shapes::OpenAi, &body)).1, Some(longest));
    for model in [r#"gpt\u002d4"#, "gpt 4", "modèle", ""] {
        let body = format!(r#"{{"model":"{model}","usage":{{"prompt_tokens":1}}}}"#);
        assert_eq!(usage(json(Shapes::OpenAi, &body)).1, None, "{model}");
    }
    // Not a string: no model, and not a give-up.
    let body = r#"{"model":{"name":"x"},"usage":{"prompt_tokens":1}}"#;
    assert_eq!(usage(json(Shapes::OpenAi, body)).1, None);
    // An earlier document's model stays when a later one's is not taken.
    let body = format!(
        "data: {{\"model\":\"gpt-4o\"}}\n\ndata: {{\"model\":\"{long}\",\"usage\":{{\"prompt_tokens\":2}}}}\n\n"
    );
    let (_, model) = usage(read(Framing::Sse, Shapes::OpenAi, body.as_bytes()).0);
    assert_eq!(model.as_deref(), Some("gpt-4o"));
}

#[test]
fn too_deep_gives_up() {
    let body = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    assert_eq!(unreadable(json_quick(body.as_bytes())), Reason::TooDeep);
    let body = format!(
        "{{\"a\":{}1{}}}",
        "[".repeat(DEPTH_MAX - 1),
        "]".repeat(DEPTH_MAX - 1)
    );
    assert_eq!(
        unreadable(json(Shapes::All, &body)),
        Reason::NoUsage,
        "just deep enough"
    );
    let body = format!("{{\"a\":{}1{}}}", "[".repeat(DEPTH_MAX), "]".repeat(DEPTH_MAX));
    assert_eq!(unreadable(json(Shapes::All, &body)), Reason::TooDeep);
    let body = format!("data: {}\n\n", "{\"a\":".repeat(10_000));
    let (outcome, _, _) = read_chunks(Framing::Sse, Shapes::All, &[body.as_bytes()]);
    assert_eq!(unreadable(outcome), Reason::TooDeep);
}

/// A 50 MB answer, generated in chunks as it would stream: given up as too large, and fed on
/// past the give-up at no cost.
#[test]
fn a_50_mb_answer_is_too_large() {
    let filler = format!("\"{}\",", "lorem ipsum dolor sit amet ".repeat(2_000));
    let mut reader = Reader::new(Framing::Json, Shapes::All);
    reader.feed(br#"{"model":"gpt-4o","choices":["#);
    let mut fed = 0;
    while fed < 50 << 20 {
        reader.feed(filler.as_bytes());
        fed += filler.len();
    }
    reader.feed(br#""end"],"usage":{"prompt_tokens":1,"completion_tokens":2}}"#);
    assert_eq!(
        reader.finish(true),
        Outcome::Unreadable {
            reason: Reason::TooLarge,
            model: None,
        }
    );
    // A stream of many small events is not one document.
    let mut reader = Reader::new(Framing::Sse, Shapes::All);
    let event = format!("data: {{\"x\":\"{}\"}}\n\n", "y".repeat(1 << 20));
    for _ in 0..20 {
        reader.feed(event.as_bytes());
    }
    reader.feed(b"data: {\"usage\":{\"input_tokens\":1}}\n\n");
    assert!(matches!(reader.finish(true), Outcome::Read(_)));
    // Nor is a long Gemini array; but one event's data past the limit is.
    let mut reader = Reader::new(Framing::Sse, Shapes::All);
    reader.feed(b"data: \"");
    let line = "z".repeat(1 << 20);
    for _ in 0..=16 {
        reader.feed(line.as_bytes());
    }
    assert_eq!(unreadable(reader.finish(true)), Reason::TooLarge);
}

#[test]
fn long_root_arrays_are_many_documents() {
    let element = format!("{{\"text\":\"{}\"}},", "y".repeat(1 << 20));
    let mut reader = Reader::new(Framing::Json, Shapes::Gemini);
    reader.feed(b"[");
    for _ in 0..20 {
        reader.feed(element.as_bytes());
    }
    reader.feed(br#"{"usageMetadata":{"promptTokenCount":3}}]"#);
    assert_eq!(reader.events(), 21);
    assert_eq!(usage(reader.finish(true)).0.input, 3);
}

#[test]
fn sse_framing_follows_the_specification() {
    // Comments, other fields, CR and CRLF line ends, data split over lines, a space kept when
    // there are two, a field without a colon.
    let body = ": keep-alive\r\n\
        event: message_delta\r\n\
        id: 7\r\n\
        retry: 1000\r\n\
        data:{\"usage\":\r\n\
        data:  {\"input_tokens\":\r\
        data: 12}}\r\r\
        : ping\n\n\
        event: x\n\
        data\n\
        \n\
        data: [DONE]\n\n";
    let (outcome, events) = read(Framing::Sse, Shapes::Anthropic, body.as_bytes());
    assert_eq!(usage(outcome).0.input, 12);
    assert_eq!(events, 3, "a comment-only block is no event");
    // `data` lines joined with a line feed: inside a number that ends it.
    let body = "data: {\"usage\":{\"input_tokens\":1\ndata: 2}}\n\n";
    let (outcome, _) = read(Framing::Sse, Shapes::Anthropic, body.as_bytes());
    assert_eq!(unreadable(outcome), Reason::Malformed);
    // Field names are exact.
    let body = "Data: {\"usage\":{\"input_tokens\":1}}\n\ndatas: {\"usage\":{\"input_tokens\":1}}\n\n";
    let (outcome, events) = read(Framing::Sse, Shapes::Anthropic, body.as_bytes());
    assert_eq!(unreadable(outcome), Reason::NoUsage);
    assert_eq!(events, 2);
}

#[test]
fn sse_malformed_events_are_skipped_and_remembered() {
    let good = "data: {\"usage\":{\"input_tokens\":4}}\n\n";
    let bad = "data: {\"usage\":{\"input_tokens\":5}\n\ndata: not json\n\n";
    let (outcome, events) = read(Framing::Sse, Shapes::All, format!("{good}{bad}").as_bytes());
    assert_eq!(usage(outcome).0.input, 4);
    assert_eq!(events, 3);
    let (outcome, _) = read(Framing::Sse, Shapes::All, bad.as_bytes());
    assert_eq!(unreadable(outcome), Reason::Malformed);
    // [DONE] and empty data are quiet; anything near them is not.
    let quiet = "data: [DONE]\n\ndata:\n\ndata: \n\nevent: end\n\n";
    assert_eq!(
        unreadable(read(Framing::Sse, Shapes::All, quiet.as_bytes()).0),
        Reason::NoUsage
    );
    for near in ["data: [DONE] \n\n", "data: [DONE\n\n", "data: [DONE]\ndata:\n\n"] {
        let outcome = read(Framing::Sse, Shapes::All, near.as_bytes()).0;
        assert_eq!(unreadable(outcome), Reason::Malformed, "{near:?}");
    }
}

#[test]
fn an_unterminated_last_event_is_discarded() {
    let body = "data: {\"usage\":{\"input_tokens\":4}}\n\ndata: {\"usage\":{\"input_tokens\":9}}\n";
    let (outcome, events) = read(Framing::Sse, Shapes::All, body.as_bytes());
    assert_eq!(usage(outcome).0.input, 4);
    assert_eq!(events, 1);
    let body = "data: {\"usage\":{\"input_tokens\":9}}";
    assert_eq!(
        unreadable(read(Framing::Sse, Shapes::All, body.as_bytes()).0),
        Reason::NoUsage
    );
}

#[test]
fn cut_bodies_keep_what_was_committed() {
    let stream = anthropic_stream();
    let cut = stream.find("event: message_delta").unwrap();
    let mut reader = Reader::new(Framing::Sse, Shapes::Anthropic);
    reader.feed(&stream.as_bytes()[..cut]);
    let (tokens_read, _) = usage(reader.finish(false));
    assert_eq!(tokens_read, tokens(40, 1, 5, 10, 0), "message_start's counts");
    // Nothing committed: cut, with the model if one was.
    let mut reader = Reader::new(Framing::Json, Shapes::All);
    reader.feed(&OPENAI_CHAT.as_bytes()[..OPENAI_CHAT.len() - 10]);
    assert_eq!(
        reader.finish(false),
        Outcome::Unreadable {
            reason: Reason::Cut,
            model: None,
        }
    );
    assert_eq!(
        reader.finish(true),
        reader.finish(false),
        "the first finish holds"
    );
    // An earlier give-up wins over the cut.
    let mut reader = Reader::new(Framing::Json, Shapes::All);
    reader.feed(b"{\"usage\":{\"prompt_tokens\":-");
    assert_eq!(unreadable(reader.finish(false)), Reason::InvalidValue);
    // Fed after finishing: nothing changes.
    let mut reader = Reader::new(Framing::Sse, Shapes::All);
    assert_eq!(unreadable(reader.finish(false)), Reason::Cut);
    reader.feed(b"data: {\"usage\":{\"input_tokens\":4}}\n\n");
    assert_eq!(unreadable(reader.finish(true)), Reason::Cut);
    assert_eq!(reader.events(), 0);
}

#[test]
fn shaped_once_a_count_key_is_seen() {
    let mut reader = Reader::new(Framing::Sse, Shapes::All);
    reader.feed(b"data: {\"usage\":{\"output_tok");
    assert!(!reader.shaped());
    reader.feed(b"ens\":");
    assert!(reader.shaped());
    let mut reader = Reader::new(Framing::Json, Shapes::Gemini);
    reader.feed(b"{\"usage\":{\"output_tokens\":3}}");
    assert!(!reader.shaped(), "not Gemini's");
}

#[test]
fn events_count_as_they_end() {
    let mut reader = Reader::new(Framing::Sse, Shapes::All);
    reader.feed(b"event: message_start\ndata: {}\n");
    assert_eq!(reader.events(), 0);
    reader.feed(b"\r\n");
    assert_eq!(reader.events(), 1);
    reader.feed(b"data: [DONE]\n\n");
    assert_eq!(reader.events(), 2);
    let mut reader = Reader::new(Framing::Json, Shapes::All);
    reader.feed(b"{\"a\":1");
    assert_eq!(reader.events(), 0);
    reader.feed(b"}");
    assert_eq!(reader.events(), 1);
}

#[test]
fn the_reader_stays_small() {
    assert!(
        std::mem::size_of::<Reader>() <= 512,
        "{}",
        std::mem::size_of::<Reader>()
    );
}

/// The fuzz target's invariants (same outcome whole and chunked, in both framings and every
/// shape; bounded counts) over every body above with bytes flipped, dropped and repeated: a
/// few thousand runs of it on stable, in every `cargo test`.
#[test]
fn mutated_bodies_keep_the_fuzz_targets_invariants() {
    let bodies = [
        OPENAI_CHAT.to_string(),
        openai_stream(true),
        RESPONSES_JSON.to_string(),
        responses_stream(),
        ANTHROPIC_JSON.to_string(),
        anthropic_stream(),
        GEMINI_JSON.to_string(),
        format!("[{}]", gemini_chunks().join("\n,\r\n")),
    ];
    let mut draw = 0x9e37_79b9_u32;
    let mut next = move |below: usize| {
        draw ^= draw << 13;
        draw ^= draw >> 17;
        draw ^= draw << 5;
        draw as usize % below
    };
    let specials = b"{}[]\",:\\\n\r 0-9en.";
    for body in &bodies {
        for _ in 0..60 {
            let mut data = vec![next(256) as u8];
            data.extend_from_slice(body.as_bytes());
            for _ in 0..=next(3) {
                let at = 1 + next(data.len() - 1);
                match next(3) {
                    0 => data[at] = specials[next(specials.len())],
                    1 => {
                        data.remove(at);
                    }
                    _ => {
                        let len = next(16).min(data.len() - at);
                        let copy = data[at..at + len].to_vec();
                        data.splice(at..at, copy);
                    }
                }
            }
            crate::fuzzing::llm_usage(&data);
        }
    }
}
