# syntax=docker/dockerfile:1
# The compose demo's application: the seeds' leaky Go client (tests/leaky/main.go), which
# builds a new http.Transport per request and so leaves one idle connection behind each time.
# Built from the repository root: docker build -f deploy/compose/leaky.Dockerfile .

FROM golang:1.24-bookworm AS build
WORKDIR /src
COPY tests/leaky/main.go ./
RUN CGO_ENABLED=0 go build -trimpath -o /leaky main.go

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /leaky /usr/local/bin/leaky
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/leaky"]
