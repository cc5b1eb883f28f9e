# syntax=docker/dockerfile:1
# The egress-sidecar image: the profile-guided release build (deploy/pgo/build.sh, the same that
# deploy/validate.sh runs and tests and benches/ measure), on distroless cc (glibc, libgcc, CA
# certificates for TLS origination, no shell), running as the distroless nonroot user.
#
#   docker build -t egress-sidecar:0.1.0 .
#   docker run --rm egress-sidecar:0.1.0 --version

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# llvm-profdata, of this rustc's LLVM, merges the training run's profile.
RUN rustup component add llvm-tools

# Two release builds and a training run between them: the instrumented sidecar is driven
# through the request paths by the trainer (deploy/pgo/train.rs, built with the dev
# dependencies), then built again with the profile. No dependency layer of its own: both
# builds compile the dependencies with their own flags, and the second with the profile.
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY benches ./benches
# The code layout (link/request-path.symbols), read by build.rs.
COPY link ./link
COPY deploy/pgo ./deploy/pgo
RUN bash deploy/pgo/build.sh \
    && cp target/release/egress-sidecar /egress-sidecar

# bookworm on both sides: the binary needs no newer glibc than the runtime image has.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /egress-sidecar /usr/local/bin/egress-sidecar
USER 65532:65532
# glibc keeps up to 7 freed chunks of each size per thread (tcache), outside every trim; after a
# burst those scattered chunks pin heap pages the rest of which is free: a fresh sidecar's
# anonymous memory grew 1.1-1.3 MiB with 2,000 WebSocket tunnels parked, 0.7-0.85 MiB with one
# chunk per size, at the same instructions per request (benches/RESULTS.md, issue 47). Set
# here because glibc reads tunables only from the environment it starts with.
ENV GLIBC_TUNABLES=glibc.malloc.tcache_count=1
# 15080: forward proxy, 15081: admin. Both bind 127.0.0.1 unless EGRESS_LISTEN/EGRESS_ADMIN
# (or the config file) say otherwise, so nothing is exposed by default.
EXPOSE 15080 15081
# Exec form: distroless has no shell. Checks /readyz on the admin listener (EGRESS_ADMIN).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/egress-sidecar", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/egress-sidecar"]
CMD ["run"]
