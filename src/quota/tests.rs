//! Unit tests of the quota against a rate-limit service in the test.
