// Command grpcleak is a gRPC health-check server and a leaky gRPC client, for
// tests/tunnel_grpc.rs.
//
//	grpcleak server
//
// serves the standard health service (grpc.health.v1, reporting SERVING) over plaintext
// HTTP/2 (h2c) on 127.0.0.1:0 and prints {"addr":"127.0.0.1:PORT"}. Each line read from
// stdin ("count") prints its counters as one JSON line: TCP connections accepted and still
// open, and health RPCs served. At stdin EOF it prints them once more and exits.
//
//	grpcleak client TARGET N
//
// runs N health checks one after another, each on a NEW grpc.NewClient(TARGET, insecure
// credentials) that is never closed (the leak: each client keeps its connection open), and
// prints one JSON summary line. Each check has 5 s; after 10 failed checks the client stops
// (a broken path should fail the test in seconds, not after N timeouts). grpc-go honours HTTPS_PROXY (and NO_PROXY) for plaintext
// targets too: it sends CONNECT TARGET to the proxy and speaks h2c inside the tunnel. Like
// Go's ProxyFromEnvironment it never proxies localhost or loopback addresses, so a test that
// wants the proxy gives a host name the proxy maps to the server; the target is then not
// resolved by the client (the proxy gets the name).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthgrpc "google.golang.org/grpc/health/grpc_health_v1"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == "server" {
		server()
		return
	}
	if len(os.Args) == 4 && os.Args[1] == "client" {
		n, err := strconv.Atoi(os.Args[3])
		if err != nil || n < 1 {
			fail("client: N must be a positive integer, not %q", os.Args[3])
		}
		client(os.Args[2], n)
		return
	}
	fmt.Fprintln(os.Stderr, "usage: grpcleak server | grpcleak client TARGET N")
	os.Exit(2)
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "grpcleak: "+format+"\n", args...)
	os.Exit(1)
}

func printJSON(v any) {
	line, err := json.Marshal(v)
	if err != nil {
		fail("json: %v", err)
	}
	fmt.Printf("%s\n", line)
}

// === server ===

// countingListener counts the TCP connections it accepts and how many are still open.
type countingListener struct {
	net.Listener
	accepted atomic.Int64
	open     atomic.Int64
}

func (l *countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.accepted.Add(1)
	l.open.Add(1)
	return &countedConn{Conn: c, l: l}, nil
}

type countedConn struct {
	net.Conn
	l      *countingListener
	closed atomic.Bool
}

func (c *countedConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.l.open.Add(-1)
	}
	return c.Conn.Close()
}

type counts struct {
	Accepted int64 `json:"accepted"`
	Open     int64 `json:"open"`
	RPCs     int64 `json:"rpcs"`
}

func server() {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail("listen: %v", err)
	}
	lis := &countingListener{Listener: inner}
	var rpcs atomic.Int64
	srv := grpc.NewServer(grpc.UnaryInterceptor(
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			rpcs.Add(1)
			return h(ctx, req)
		}))
	healthgrpc.RegisterHealthServer(srv, health.NewServer()) // "" is SERVING
	go func() {
		if err := srv.Serve(lis); err != nil {
			fail("serve: %v", err)
		}
	}()
	printJSON(map[string]string{"addr": inner.Addr().String()})

	report := func() {
		printJSON(counts{Accepted: lis.accepted.Load(), Open: lis.open.Load(), RPCs: rpcs.Load()})
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		report()
	}
	report()
	srv.Stop()
}

// === client ===

const (
	checkTimeout = 5 * time.Second
	maxErrors    = 10
)

type summary struct {
	Target string `json:"target"`
	// The proxy grpc-go's resolver picks for the target (HTTPS_PROXY, NO_PROXY), "" for none.
	Proxy      string         `json:"proxy"`
	Checks     int            `json:"checks"`
	Statuses   map[string]int `json:"statuses"`
	Run        int            `json:"run"` // checks made: N unless the client gave up
	Errors     int            `json:"errors"`
	FirstError string         `json:"first_error"`
	ElapsedMs  int64          `json:"elapsed_ms"`
}

func client(target string, n int) {
	// The same question grpc-go's delegating resolver asks (for a dns target, the endpoint
	// as an https URL's host).
	proxy := ""
	if u, err := http.ProxyFromEnvironment(&http.Request{URL: &url.URL{Scheme: "https", Host: target}}); err != nil {
		fail("ProxyFromEnvironment: %v", err)
	} else if u != nil {
		proxy = u.String()
	}
	out := summary{Target: target, Proxy: proxy, Checks: n, Statuses: map[string]int{}}
	leaked := make([]*grpc.ClientConn, 0, n)
	start := time.Now()
	for i := 0; i < n && out.Errors < maxErrors; i++ {
		out.Run++
		cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			fail("NewClient(%q): %v", target, err)
		}
		leaked = append(leaked, cc) // never closed
		ctx, cancel := context.WithTimeout(context.Background(), checkTimeout)
		resp, err := healthgrpc.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err != nil {
			out.Errors++
			out.Statuses["rpc_"+status.Code(err).String()]++
			if out.FirstError == "" {
				out.FirstError = fmt.Sprintf("check %d: %v", i, err)
			}
			continue
		}
		out.Statuses[resp.GetStatus().String()]++
	}
	out.ElapsedMs = time.Since(start).Milliseconds()
	printJSON(out)
	_ = leaked
}
