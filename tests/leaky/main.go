// Command leaky reproduces the classic Go HTTP client leak: every request builds a new
// http.Transport (no IdleConnTimeout) and a new http.Client, reads and closes the body, and
// never calls CloseIdleConnections. Each request therefore leaves one idle keep-alive
// connection behind, with its readLoop and writeLoop goroutines, in a Transport nobody can
// reach any more. Only the peer closing the connection frees it.
//
// It prints JSON lines to stdout: "baseline" before any request, "after_requests" once all
// requests are done, and "after_wait" after -wait.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"runtime"
	"strings"
	"time"
)

type report struct {
	Phase      string `json:"phase"`
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

func main() {
	n := flag.Int("n", 100, "requests to send")
	target := flag.String("url", "", "URL to GET")
	proxy := flag.String("proxy", "", "proxy URL (empty: connect directly)")
	wait := flag.Duration("wait", time.Second, "how long to wait after the requests")
	flag.Parse()
	if *target == "" {
		fmt.Fprintln(os.Stderr, "leaky: -url is required")
		os.Exit(2)
	}
	var proxyURL *url.URL
	if *proxy != "" {
		u, err := url.Parse(*proxy)
		if err != nil {
			fmt.Fprintf(os.Stderr, "leaky: -proxy: %v\n", err)
			os.Exit(2)
		}
		proxyURL = u
	}

	emit(report{Phase: "baseline"})
	start := time.Now()
	ok, errs := 0, 0
	firstErr := ""
	fail := func(err error) {
		errs++
		if firstErr == "" {
			firstErr = err.Error()
		}
	}
	for i := 0; i < *n; i++ {
		// The leak: a new Transport per request, never closed.
		tr := &http.Transport{}
		if proxyURL != nil {
			// ProxyURL applies no NO_PROXY or loopback exceptions (ProxyFromEnvironment does).
			tr.Proxy = http.ProxyURL(proxyURL)
		}
		client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		resp, err := client.Get(*target)
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
	emit(report{Phase: "after_requests", OK: ok, Errors: errs, ElapsedMs: elapsed, FirstError: firstErr})
	time.Sleep(*wait)
	emit(report{Phase: "after_wait", OK: ok, Errors: errs, ElapsedMs: time.Since(start).Milliseconds(), FirstError: firstErr})
}
