// Command validate loads deploy/compose/compose.yaml with compose-go, the library docker
// compose itself uses, so the file is checked against the current Compose spec (schema,
// interpolation, extends and anchors, depends_on and network references). It then checks the
// rules the demo depends on, which the spec cannot express:
//
//   - every sidecar service (image egress-sidecar:*) has an exec-form healthcheck running
//     `egress-sidecar healthcheck` (the image has no shell) and mounts the config file that
//     tests/deploy.rs starts the release binary with;
//   - every app (a service with HTTP_PROXY) has http_proxy equal to it, waits for its sidecar
//     with condition service_healthy, and reaches it in one of the two patterns: the shared
//     network namespace (network_mode service:X, proxy on 127.0.0.1) or by service name on a
//     network marked internal, with the sidecar listening on 0.0.0.0;
//   - both patterns are shown.
//
// Usage: go run . [path/to/compose.yaml]   (exit 1 and one line per problem on failure)
package main

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
	"github.com/compose-spec/compose-go/v2/types"
)

const sidecarConfig = "/etc/egress-sidecar/config.yaml"

func main() {
	file := "../compose.yaml"
	if len(os.Args) > 1 {
		file = os.Args[1]
	}
	problems, err := check(file)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", file, err)
		os.Exit(1)
	}
	for _, p := range problems {
		fmt.Fprintf(os.Stderr, "%s: %s\n", file, p)
	}
	if len(problems) > 0 {
		os.Exit(1)
	}
	fmt.Printf("%s: valid (Compose spec, both sidecar patterns, healthcheck-gated startup)\n", file)
}

func check(file string) ([]string, error) {
	opts, err := cli.NewProjectOptions([]string{file},
		cli.WithWorkingDirectory(filepath.Dir(file)),
		// Only the file decides: no .env or shell variables leak into the check.
		cli.WithEnv(nil),
		cli.WithConsistency(true),
	)
	if err != nil {
		return nil, err
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		return nil, err
	}
	var problems []string
	add := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	sidecars := map[string]types.ServiceConfig{}
	for name, svc := range project.Services {
		if strings.HasPrefix(svc.Image, "egress-sidecar:") {
			sidecars[name] = svc
			checkSidecar(name, svc, add)
		}
	}
	if len(sidecars) == 0 {
		add("no sidecar service (image egress-sidecar:*)")
	}
	patterns := map[string]bool{}
	for name, svc := range project.Services {
		if proxy := env(svc, "HTTP_PROXY"); proxy != "" {
			if p := checkApp(project, name, svc, proxy, sidecars, add); p != "" {
				patterns[p] = true
			}
		}
	}
	for _, p := range []string{"shared namespace", "separate service"} {
		if !patterns[p] {
			add("no app uses the %s pattern", p)
		}
	}
	slices.Sort(problems)
	return problems, nil
}

func env(svc types.ServiceConfig, key string) string {
	if v, ok := svc.Environment[key]; ok && v != nil {
		return *v
	}
	return ""
}

func checkSidecar(name string, svc types.ServiceConfig, add func(string, ...any)) {
	hc := svc.HealthCheck
	if hc == nil || hc.Disable || len(hc.Test) < 3 || hc.Test[0] != "CMD" ||
		!strings.HasSuffix(hc.Test[1], "/egress-sidecar") || hc.Test[2] != "healthcheck" {
		add("service %s: healthcheck must be [CMD, .../egress-sidecar, healthcheck] (no shell in the image)", name)
	}
	mounted := false
	for _, v := range svc.Volumes {
		if v.Type == types.VolumeTypeBind && v.Target == sidecarConfig {
			mounted = true
			if _, err := os.Stat(v.Source); err != nil {
				add("service %s: config file %s: %v", name, v.Source, err)
			} else if filepath.Base(v.Source) != "egress-sidecar.yaml" {
				add("service %s: mounts %s, not the egress-sidecar.yaml the tests run", name, v.Source)
			}
		}
	}
	if !mounted || env(svc, "EGRESS_CONFIG") != sidecarConfig {
		add("service %s: must mount egress-sidecar.yaml at %s and set EGRESS_CONFIG to it", name, sidecarConfig)
	}
}

// checkApp returns the pattern the app uses, or "" when it uses neither correctly.
func checkApp(project *types.Project, name string, svc types.ServiceConfig, proxy string,
	sidecars map[string]types.ServiceConfig, add func(string, ...any)) string {
	if lower := env(svc, "http_proxy"); lower != proxy {
		add("service %s: http_proxy %q differs from HTTP_PROXY %q (curl reads only the lowercase one)", name, lower, proxy)
	}
	u, err := url.Parse(proxy)
	if err != nil || u.Scheme != "http" || u.Port() != "15080" {
		add("service %s: HTTP_PROXY %q is not http://HOST:15080", name, proxy)
		return ""
	}
	var sidecar, pattern string
	if target, ok := strings.CutPrefix(svc.NetworkMode, "service:"); ok {
		sidecar, pattern = target, "shared namespace"
		if u.Hostname() != "127.0.0.1" {
			add("service %s: in %s's namespace HTTP_PROXY must be http://127.0.0.1:15080", name, target)
		}
	} else {
		sidecar, pattern = u.Hostname(), "separate service"
		if !strings.HasPrefix(env(sidecars[sidecar], "EGRESS_LISTEN"), "0.0.0.0:") {
			add("service %s: sidecar %s must listen on 0.0.0.0 to be reachable by name", name, sidecar)
		}
		if !sharesInternalNetwork(project, svc, sidecars[sidecar]) {
			add("service %s: shares no internal network with %s", name, sidecar)
		}
	}
	if _, ok := sidecars[sidecar]; !ok {
		add("service %s: proxy %s is not a sidecar service", name, sidecar)
		return ""
	}
	if dep, ok := svc.DependsOn[sidecar]; !ok || dep.Condition != types.ServiceConditionHealthy {
		add("service %s: must depend on %s with condition service_healthy", name, sidecar)
	}
	return pattern
}

func sharesInternalNetwork(project *types.Project, app, sidecar types.ServiceConfig) bool {
	for net := range app.Networks {
		_, both := sidecar.Networks[net]
		if both && project.Networks[net].Internal {
			return true
		}
	}
	return false
}
