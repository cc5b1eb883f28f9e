// Command leaky reproduces the classic Go HTTP client leak: every request builds a new
// http.Transport (no IdleConnTimeout) and a new http.Client, reads and closes the body, and
// never calls CloseIdleConnections. Each request therefore leaves one idle keep-alive
// connection behind, with its readLoop and writeLoop goroutines, in a Transport nobody can
// reach any more. Only the peer closing the connection frees it.
//
// It prints JSON lines to stdout: "baseline" before any request, "after_requests" once all
// requests are done, and "after_wait" after -wait; with -rounds the last two repeat per round.
//
// With -unix PATH every connection (to the proxy, or to the URL's host) is dialed to that Unix
// socket instead: the sidecar's listen_unix.
//
// Every flag can also come from the environment (LEAKY_N, LEAKY_URL, LEAKY_PROXY, LEAKY_WAIT,
// LEAKY_ROUNDS, LEAKY_UNIX) so that the docker compose demo (deploy/compose) can run it unchanged;
// -proxy=env takes the proxy from HTTP_PROXY/NO_PROXY the way most Go programs do.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

type report struct {
	Phase      string `json:"phase"`
	Round      int    `json:"round,omitempty"`
	Goroutines int    `json:"goroutines"`
	Sockets    int    `json:"sockets"`
	OK         int    `json:"ok"`
	Errors     int    `json:"errors"`
	ElapsedMs  int64  `json:"elapsed_ms"`
	FirstError string `json:"first_error,omitempty"`
}

// sockets counts the entries of /proc/self/fd that are sockets.
func sockets() int {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	n := 0
	for _, e := range entries {
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		if err == nil && strings.HasPrefix(target, "socket:") {
			n++
		}
	}
	return n
}

func emit(r report) {
	r.Goroutines = runtime.NumGoroutine()
	r.Sockets = sockets()
	line, _ := json.Marshal(r)
	fmt.Println(string(line))
}

// env returns $LEAKY_<name> when set, else def: the default of the flag of that name.
func env(name, def string) string {
	if v, ok := os.LookupEnv("LEAKY_" + strings.ToUpper(name)); ok {
		return v
	}
	return def
}

func envInt(name string, def int) int {
	v, err := strconv.Atoi(env(name, strconv.Itoa(def)))
	if err != nil {
		fmt.Fprintf(os.Stderr, "leaky: LEAKY_%s: %v\n", strings.ToUpper(name), err)
		os.Exit(2)
	}
	return v
}

func envDuration(name string, def time.Duration) time.Duration {
	v, err := time.ParseDuration(env(name, def.String()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "leaky: LEAKY_%s: %v\n", strings.ToUpper(name), err)
		os.Exit(2)
	}
	return v
}

func main() {
	n := flag.Int("n", envInt("n", 100), "requests to send per round")
	target := flag.String("url", env("url", ""), "URL to GET")
	proxy := flag.String("proxy", env("proxy", ""), "proxy URL (empty: connect directly; env: HTTP_PROXY/NO_PROXY)")
	wait := flag.Duration("wait", envDuration("wait", time.Second), "how long to wait after each round's requests")
	rounds := flag.Int("rounds", envInt("rounds", 1), "rounds of -n requests and -wait (0: forever)")
	unixPath := flag.String("unix", env("unix", ""), "dial this Unix socket for every connection")
	flag.Parse()
	if *target == "" {
		fmt.Fprintln(os.Stderr, "leaky: -url is required")
		os.Exit(2)
	}
	var proxyFunc func(*http.Request) (*url.URL, error)
	switch *proxy {
	case "":
	case "env":
		proxyFunc = http.ProxyFromEnvironment
	default:
		u, err := url.Parse(*proxy)
		if err != nil {
			fmt.Fprintf(os.Stderr, "leaky: -proxy: %v\n", err)
			os.Exit(2)
		}
		// ProxyURL applies no NO_PROXY or loopback exceptions (ProxyFromEnvironment does).
		proxyFunc = http.ProxyURL(u)
	}

	var dial func(ctx context.Context, network, addr string) (net.Conn, error)
	if *unixPath != "" {
		dial = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", *unixPath)
		}
	}

	emit(report{Phase: "baseline"})
	for round := 1; *rounds == 0 || round <= *rounds; round++ {
		runRound(round, *n, *target, proxyFunc, dial, *wait)
	}
}

// runRound sends n leaky requests, reports, waits, and reports again.
func runRound(round, n int, target string, proxyFunc func(*http.Request) (*url.URL, error),
	dial func(ctx context.Context, network, addr string) (net.Conn, error), wait time.Duration) {
	start := time.Now()
	ok, errs := 0, 0
	firstErr := ""
	fail := func(err error) {
		errs++
		if firstErr == "" {
			firstErr = err.Error()
		}
	}
	for i := 0; i < n; i++ {
		// The leak: a new Transport per request, never closed.
		tr := &http.Transport{Proxy: proxyFunc, DialContext: dial}
		client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		resp, err := client.Get(target)
		if err != nil {
			fail(err)
			continue
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil {
			fail(err)
		} else if resp.StatusCode != http.StatusOK {
			fail(fmt.Errorf("status %d (x-egress-error: %q)", resp.StatusCode, resp.Header.Get("x-egress-error")))
		} else {
			ok++
		}
	}
	elapsed := time.Since(start).Milliseconds()
	emit(report{Phase: "after_requests", Round: round, OK: ok, Errors: errs, ElapsedMs: elapsed, FirstError: firstErr})
	time.Sleep(wait)
	emit(report{Phase: "after_wait", Round: round, OK: ok, Errors: errs, ElapsedMs: time.Since(start).Milliseconds(), FirstError: firstErr})
}
