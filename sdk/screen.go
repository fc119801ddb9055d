package sdk

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/coder/websocket"
	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// maxScreenshot bounds a screenshot's PNG.
const maxScreenshot = 64 << 20

// Screenshot is the sandbox's screen now (a full VM's, backend vm), as
// PNG, with its size and the sandbox's count of screenshots.
func (s *Sandbox) Screenshot(ctx context.Context) ([]byte, api.Screenshot, error) {
	var info api.Screenshot
	resp, err := s.c.send(ctx, "GET", s.path("/screen"), nil)
	if err != nil {
		return nil, info, err
	}
	defer closeBody(resp.Body)
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxScreenshot+1))
	if err != nil {
		return nil, info, err
	}
	if len(b) > maxScreenshot {
		return nil, info, fmt.Errorf("a screenshot of more than %d bytes", maxScreenshot)
	}
	info.Width, _ = strconv.Atoi(resp.Header.Get(api.HeaderScreenWidth))
	info.Height, _ = strconv.Atoi(resp.Header.Get(api.HeaderScreenHeight))
	info.Seq, _ = strconv.ParseInt(resp.Header.Get(api.HeaderScreenSeq), 10, 64)
	return b, info, nil
}

// Input acts on the sandbox's keyboard or mouse (a full VM's): one
// of in's fields.
func (s *Sandbox) Input(ctx context.Context, in api.Input) error {
	b, _ := json.Marshal(in)
	return s.c.do(ctx, "POST", s.path("/input"), bytes.NewReader(b), nil)
}

// Type types text on the sandbox's keyboard.
func (s *Sandbox) Type(ctx context.Context, text string) error {
	return s.Input(ctx, api.Input{Text: text})
}

// Press presses a key by name ("Return", "ctrl+alt+t").
func (s *Sandbox) Press(ctx context.Context, key string) error {
	return s.Input(ctx, api.Input{Key: key})
}

// Click clicks the left button at (x, y) of the screen.
func (s *Sandbox) Click(ctx context.Context, x, y int) error {
	return s.Input(ctx, api.Input{Click: &api.Click{Point: api.Point{X: x, Y: y}}})
}

// VNC grants a token to the sandbox's screen over VNC (a full VM's),
// ending any grant before it: DialVNC opens it, as does a noVNC client
// given the WebSocket's URL (VNCURL).
func (s *Sandbox) VNC(ctx context.Context) (api.VNC, error) {
	var g api.VNC
	return g, s.c.do(ctx, "POST", s.path("/vnc"), nil, &g)
}

// RevokeVNC ends the sandbox's VNC grant, and the connections it opened.
func (s *Sandbox) RevokeVNC(ctx context.Context) error {
	return s.c.do(ctx, "DELETE", s.path("/vnc"), nil, nil)
}

// VNCURL is the WebSocket URL of grant g on the client's worker, its
// token in the query (what noVNC's url option takes).
func (c *Client) VNCURL(g api.VNC) string {
	base := strings.TrimSuffix(c.base, "/"+api.Version)
	base = "ws" + strings.TrimPrefix(base, "http")
	return base + g.Path + "?token=" + url.QueryEscape(g.Token)
}

// DialVNC opens grant g's WebSocket: the connection speaks RFB with the
// sandbox's VNC server, as a VNC viewer's TCP connection would.
func (c *Client) DialVNC(ctx context.Context, g api.VNC) (net.Conn, error) {
	ws, resp, err := websocket.Dial(ctx, c.VNCURL(g), &websocket.DialOptions{HTTPClient: c.hc, Subprotocols: []string{"binary"}})
	if err != nil {
		switch {
		case resp == nil:
			return nil, fmt.Errorf("open sandbox %s's VNC: %v: %w", g.Sandbox, err, ErrInfra)
		case resp.StatusCode == http.StatusForbidden:
			return nil, fmt.Errorf("the worker refused the VNC grant of sandbox %s (revoked, replaced, or the sandbox stopped): ask for another: %w", g.Sandbox, errdefs.ErrPermissionDenied)
		}
		var e api.Error // (the body, as the Dial read it)
		if resp.Body == nil || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&e) != nil || e.Message == "" {
			e = api.Error{Class: api.ClassOfStatus(resp.StatusCode), Message: fmt.Sprintf("open sandbox %s's VNC: %s", g.Sandbox, resp.Status)}
		}
		return nil, &Error{API: e}
	}
	ws.SetReadLimit(-1) // a screen's update may be large
	return websocket.NetConn(context.WithoutCancel(ctx), ws, websocket.MessageBinary), nil
}
