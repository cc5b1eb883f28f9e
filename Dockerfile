# syntax=docker/dockerfile:1
# The egress-sidecar image: a release build (the same `cargo build --release --locked` that
# deploy/validate.sh runs and tests), on distroless cc (glibc, libgcc, CA certificates for TLS
# origination, no shell), running as the distroless nonroot user.
#
#   docker build -t egress-sidecar:0.1.0 .
#   docker run --rm egress-sidecar:0.1.0 --version

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src

# Dependencies first, in their own layer: it is rebuilt only when Cargo.toml or Cargo.lock
# change. Stub sources stand in for src/ so cargo can build the dependency graph.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && echo '' > src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

# The real sources. touch: COPY keeps the files' old mtimes, which cargo would otherwise take
# as older than the stub build and skip.
COPY src ./src
# build.rs: link settings (RELR, and the code layout of link/request-path.symbols).
COPY build.rs ./
COPY link ./link
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked \
    && cp target/release/egress-sidecar /egress-sidecar

# bookworm on both sides: the binary needs no newer glibc than the runtime image has.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /egress-sidecar /usr/local/bin/egress-sidecar
USER 65532:65532
# 15080: forward proxy, 15081: admin. Both bind 127.0.0.1 unless EGRESS_LISTEN/EGRESS_ADMIN
# (or the config file) say otherwise, so nothing is exposed by default.
EXPOSE 15080 15081
# Exec form: distroless has no shell. Checks /readyz on the admin listener (EGRESS_ADMIN).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["/usr/local/bin/egress-sidecar", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/egress-sidecar"]
CMD ["run"]
