// Command goenv GETs the URL given as its only argument with Go's default client, whose
// transport picks its proxy with http.ProxyFromEnvironment (HTTP_PROXY, NO_PROXY, ...). It
// prints "status=<code>" on one line and then the body.
//
// ProxyFromEnvironment never proxies requests to localhost or loopback addresses, which is why
// the test gives it a configured host name (the sidecar maps it to a static address).
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: goenv URL")
		os.Exit(2)
	}
	req, err := http.NewRequest(http.MethodGet, os.Args[1], nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "goenv:", err)
		os.Exit(1)
	}
	if proxy, err := http.ProxyFromEnvironment(req); err != nil || proxy == nil {
		fmt.Fprintf(os.Stderr, "goenv: ProxyFromEnvironment chose no proxy for %s (err %v)\n", req.URL, err)
		os.Exit(1)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		fmt.Fprintln(os.Stderr, "goenv:", err)
		os.Exit(1)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		fmt.Fprintln(os.Stderr, "goenv: reading body:", err)
		os.Exit(1)
	}
	fmt.Printf("status=%d\n%s", resp.StatusCode, body)
}
