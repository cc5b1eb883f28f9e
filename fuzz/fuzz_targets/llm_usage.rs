#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| egress_sidecar::fuzzing::llm_usage(data));
