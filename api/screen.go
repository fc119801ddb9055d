package api

import "strings"

// Screenshot is what GET /v1/sandboxes/NAME/screen answers beside the
// PNG (its body): the screen's size, and the sandbox's count of
// screenshots, which grows by one with each.
type Screenshot struct {
	Width  int   `json:"width"`
	Height int   `json:"height"`
	Seq    int64 `json:"seq"`
}

// Headers of a screenshot's answer, Screenshot's fields.
const (
	HeaderScreenWidth  = "X-Dsec-Screen-Width"
	HeaderScreenHeight = "X-Dsec-Screen-Height"
	HeaderScreenSeq    = "X-Dsec-Screen-Seq"
)

// Input is one action on a sandbox's keyboard or mouse (POST
// /v1/sandboxes/NAME/input): exactly one of its fields. Points are
// pixels of the screen as its screenshots show it, (0, 0) its top left.
type Input struct {
	// Text is typed (ASCII, on a US keyboard).
	Text string `json:"text,omitempty"`
	// Key is pressed: a key by name, with modifiers joined by "+"
	// ("Return", "ctrl+alt+t", "F5", "a").
	Key string `json:"key,omitempty"`
	// Move moves the pointer.
	Move *Point `json:"move,omitempty"`
	// Click moves the pointer and clicks.
	Click *Click `json:"click,omitempty"`
	// Drag presses the left button at From, moves to To and releases.
	Drag *Drag `json:"drag,omitempty"`
	// Scroll turns the wheel: notches down (negative: up).
	Scroll int `json:"scroll,omitempty"`
}

// Point is a pixel of the screen.
type Point struct {
	X int `json:"x"`
	Y int `json:"y"`
}

// Click is a click at a point: its button (left, middle or right;
// none: left), twice with Double.
type Click struct {
	Point
	Button string `json:"button,omitempty"`
	Double bool   `json:"double,omitempty"`
}

// Drag is a press at From, a move to To, a release.
type Drag struct {
	From Point `json:"from"`
	To   Point `json:"to"`
}

// VNC is a grant to watch, and drive, a full VM's screen over VNC (POST
// /v1/sandboxes/NAME/vnc): a WebSocket at Path (its binary messages the
// RFB protocol, as noVNC speaks it) that opens with Token alone (the
// query's token, or an Authorization: Bearer header), until the grant
// is revoked (DELETE /v1/sandboxes/NAME/vnc), another replaces it, the
// sandbox stops or its worker restarts. Off until asked for.
type VNC struct {
	Sandbox string `json:"sandbox"`
	Path    string `json:"path"` // /v1/vnc/NAME
	Token   string `json:"token"`
}

// VNCPath is the path of a sandbox's VNC WebSocket.
func VNCPath(name string) string { return "/" + Version + "/vnc/" + name }

// VNCSandbox is the sandbox a VNC WebSocket's request (GET VNCPath)
// names, given the request's method and path; "": it is no such
// request. A grant's token alone opens it: a worker, and a gateway
// relaying it, take it before any API token.
func VNCSandbox(method, path string) string {
	name, ok := strings.CutPrefix(path, VNCPath(""))
	if !ok || method != "GET" || ValidName(name) != nil {
		return ""
	}
	return name
}

// VNCRefused is the one answer (403) to a VNC WebSocket that does not
// open, whatever is wrong: no such sandbox, no grant, a wrong token.
var VNCRefused = Error{Class: ClassDenied, Message: "no VNC grant for that sandbox and token: ask for one (dsec vnc SANDBOX)"}
