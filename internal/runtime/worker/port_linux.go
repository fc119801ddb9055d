package worker

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// port relays an HTTP request (a WebSocket's upgrade too) to a port on
// the sandbox's own address, that of its NAT network: ANY
// /v1/sandboxes/{name}/ports/{port}/{path...}. What E2B's PORT-ID host
// names goes through here, so that a front or a gateway on another
// host reaches a sandbox's server as one on this host would. The
// sandbox sees none of the caller's credentials; its Host is the one
// X-Forwarded-Host names (the caller's), else ADDRESS:PORT.
func (w *worker) port(rw http.ResponseWriter, r *http.Request) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return
	}
	p, err := strconv.Atoi(r.PathValue("port"))
	if err != nil || p <= 0 || p > 65535 {
		fail(rw, fmt.Errorf("bad port %q: give a port number, 1 to 65535: %w", r.PathValue("port"), errdefs.ErrInvalidArgument))
		return
	}
	st := e.sb.Current()
	if st.NAT == nil || st.Status != api.StatusRunning {
		fail(rw, fmt.Errorf("sandbox %s has no address to reach port %d at (running, under a policy of network mode nat): %w", e.sb.Name, p, errdefs.ErrUnavailable))
		return
	}
	target := &url.URL{Scheme: "http", Host: st.NAT.Sandbox + ":" + strconv.Itoa(p)}
	proxy := &httputil.ReverseProxy{FlushInterval: -1, Transport: portTransport,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.URL.Path, pr.Out.URL.RawPath = "/"+pr.In.PathValue("path"), ""
			pr.Out.Host = target.Host
			if h := pr.In.Header.Get("X-Forwarded-Host"); h != "" { // (the In's: Rewrite's Out has none)
				pr.Out.Host = h
			}
			for _, h := range []string{"Authorization", auth.OnBehalfHeader, "X-Access-Token", "E2b-Traffic-Access-Token", "X-Api-Key",
				e2b.HeaderActAs, e2b.HeaderActAsToken, e2b.HeaderTemplate, e2b.HeaderRecord, e2b.HeaderDomain, e2b.HeaderUser} {
				pr.Out.Header.Del(h) // the sandbox sees none of the caller's secrets
			}
		},
		ErrorHandler: func(rw http.ResponseWriter, _ *http.Request, err error) {
			fail(rw, fmt.Errorf("sandbox %s port %d: %v: %w", e.sb.Name, p, err, errdefs.ErrUnavailable))
		}}
	http.NewResponseController(rw).EnableFullDuplex()
	proxy.ServeHTTP(rw, r)
}

// portTransport carries the port route's requests: no proxy of the
// worker's environment, and each connection marked as the worker's own
// (network.HostMark), which alone a sandbox's answers reach.
var portTransport = &http.Transport{
	DialContext: (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second,
		Control: func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(network.HostMark))
			}); err != nil {
				return err
			}
			return serr
		}}).DialContext,
	MaxIdleConnsPerHost: 16, IdleConnTimeout: 30 * time.Second, DisableCompression: true,
}
