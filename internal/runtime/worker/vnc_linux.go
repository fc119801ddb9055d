package worker

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/coder/websocket"
	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// VNC: a full VM's QEMU serves its screen over VNC on a unix socket in
// the sandbox's directory, which nothing but the worker reaches. A
// sandbox's owner asks for a grant (POST /v1/sandboxes/NAME/vnc): a
// token of that sandbox alone, which opens a WebSocket (GET
// /v1/vnc/NAME) whose binary messages carry RFB to and from the socket,
// as noVNC speaks it. The token is the WebSocket's only credential (a
// browser's WebSocket sends no Authorization header): it opens nothing
// else, and a new grant, a revocation, the sandbox's stop or removal,
// or the worker's restart ends it and every connection it opened.

// maxVNCMessage bounds a viewer's message (a clipboard's text, say).
const maxVNCMessage = 4 << 20

// vncGrants are the worker's grants, by sandbox name.
type vncGrants struct {
	mu sync.Mutex
	m  map[string]*vncGrant
}

type vncGrant struct {
	token  string
	id     string          // the sandbox's ID: a new one of that name is another
	ctx    context.Context // ends the grant's connections
	cancel context.CancelFunc
}

// grant makes the grant of sandbox name, of ID id, ending the one
// before.
func (g *vncGrants) grant(name, id string) string {
	b := make([]byte, 24)
	rand.Read(b)
	ctx, cancel := context.WithCancel(context.Background())
	n := &vncGrant{token: base64.RawURLEncoding.EncodeToString(b), id: id, ctx: ctx, cancel: cancel}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.m == nil {
		g.m = map[string]*vncGrant{}
	}
	if old := g.m[name]; old != nil {
		old.cancel()
	}
	g.m[name] = n
	return n.token
}

// revoke ends name's grant, if any.
func (g *vncGrants) revoke(name string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if old := g.m[name]; old != nil {
		old.cancel()
		delete(g.m, name)
	}
}

// check is the grant token opens for name (nil: none).
func (g *vncGrants) check(name, token string) *vncGrant {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := g.m[name]
	if n == nil || token == "" || subtle.ConstantTimeCompare([]byte(n.token), []byte(token)) != 1 {
		return nil
	}
	return n
}

// grantVNC grants the caller a token to its sandbox's screen over VNC.
func (w *worker) grantVNC(r *http.Request, _ none) (api.VNC, error) {
	e, err := w.get(r)
	if err != nil {
		return api.VNC{}, err
	}
	if _, err := e.sb.VNC(); err != nil {
		return api.VNC{}, err
	}
	token := w.vnc.grant(e.sb.Name, e.sb.ID)
	w.log.Info("granted VNC", "sandbox", e.sb.Name, "by", ownerOf(r.Context()))
	return api.VNC{Sandbox: e.sb.Name, Path: api.VNCPath(e.sb.Name), Token: token}, nil
}

// revokeVNC ends the sandbox's grant and its connections.
func (w *worker) revokeVNC(r *http.Request, _ none) (none, error) {
	e, err := w.get(r)
	if err != nil {
		return none{}, err
	}
	w.vnc.revoke(e.sb.Name)
	return none{}, nil
}

// vncSocket carries a grant's WebSocket to the sandbox's VNC server: the
// tokens' front serves it alone, outside the API's routes. Whatever is
// wrong (no sandbox, no grant, a wrong token) is one answer, which says
// nothing of which.
func (w *worker) vncSocket(rw http.ResponseWriter, r *http.Request) {
	name := api.VNCSandbox(r.Method, r.URL.Path)
	token := r.URL.Query().Get("token")
	if h, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && token == "" {
		token = h
	}
	refuse := func() {
		unread(rw, r)
		answer(rw, http.StatusForbidden, api.VNCRefused)
	}
	g := w.vnc.check(name, token)
	if name == "" || g == nil {
		refuse()
		return
	}
	w.mu.Lock()
	e := w.sandboxes[name]
	ok := e != nil && e.sb != nil && e.gone == nil && e.sb.ID == g.id
	w.mu.Unlock()
	if !ok {
		refuse()
		return
	}
	sock, err := e.sb.VNC()
	if err != nil {
		fail(rw, err)
		return
	}
	var d net.Dialer
	vnc, err := d.DialContext(r.Context(), "unix", sock)
	if err != nil {
		fail(rw, fmt.Errorf("sandbox %s's VNC server: %v: %w", name, err, errdefs.ErrUnavailable))
		return
	}
	defer vnc.Close()
	// Any origin: the token, not a cookie, is the credential.
	ws, err := websocket.Accept(rw, r, &websocket.AcceptOptions{Subprotocols: []string{"binary"}, InsecureSkipVerify: true})
	if err != nil {
		return // Accept answered
	}
	ws.SetReadLimit(maxVNCMessage)
	ctx, cancel := context.WithCancel(g.ctx)
	defer cancel()
	conn := websocket.NetConn(ctx, ws, websocket.MessageBinary)
	defer conn.Close()
	go func() { // the grant's end, or the client's, ends both ways
		<-ctx.Done()
		conn.Close()
		vnc.Close()
	}()
	go func() {
		io.Copy(conn, vnc)
		cancel()
	}()
	io.Copy(vnc, conn)
}
