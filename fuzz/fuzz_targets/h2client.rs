#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| egress_sidecar::fuzzing::h2client(data));
