// Package screen turns what a user asks of a VM's screen, keyboard and
// mouse (text to type, keys to press, a click at a point) into QEMU's
// input: key presses as QMP send-key's qcodes (a US keyboard's), the
// pointer as input-send-event's absolute axes (a tablet's 0..32767 over
// the screen, whatever its size) and buttons. It parses what tenants
// send: every error says what is wrong and what to give.
package screen

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/containerd/errdefs"
)

// MaxText bounds what one request types.
const MaxText = 4096

// Key is one key press: the qcodes held together (a combination's
// modifiers first), as QMP's send-key takes them.
type Key []string

// shifted are the characters a US keyboard types with shift, and the
// key under them.
var shifted = map[rune]string{
	'!': "1", '@': "2", '#': "3", '$': "4", '%': "5", '^': "6", '&': "7", '*': "8", '(': "9", ')': "0",
	'_': "minus", '+': "equal", '{': "bracket_left", '}': "bracket_right", '|': "backslash",
	':': "semicolon", '"': "apostrophe", '~': "grave_accent", '<': "comma", '>': "dot", '?': "slash",
}

// plain are the characters a US keyboard types without shift, beyond
// letters and digits.
var plain = map[rune]string{
	' ': "spc", '\n': "ret", '\t': "tab", '-': "minus", '=': "equal", '[': "bracket_left", ']': "bracket_right",
	'\\': "backslash", ';': "semicolon", '\'': "apostrophe", '`': "grave_accent", ',': "comma", '.': "dot", '/': "slash",
}

// Text is the key presses that type s on a US keyboard.
func Text(s string) ([]Key, error) {
	if len(s) > MaxText {
		return nil, fmt.Errorf("%d bytes of text to type: give at most %d at once: %w", len(s), MaxText, errdefs.ErrInvalidArgument)
	}
	if !utf8.ValidString(s) {
		return nil, fmt.Errorf("text to type is not UTF-8: %w", errdefs.ErrInvalidArgument)
	}
	var out []Key
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			out = append(out, Key{string(r)})
		case r >= 'A' && r <= 'Z':
			out = append(out, Key{"shift", string(r - 'A' + 'a')})
		case plain[r] != "":
			out = append(out, Key{plain[r]})
		case shifted[r] != "":
			out = append(out, Key{"shift", shifted[r]})
		default:
			return nil, fmt.Errorf("%q cannot be typed on a US keyboard: type ASCII text, or press keys by name: %w", r, errdefs.ErrInvalidArgument)
		}
	}
	return out, nil
}

// names are key names users give (xdotool's and E2B's among them, any
// case) and their qcodes.
var names = map[string]string{
	"return": "ret", "enter": "ret", "ret": "ret", "tab": "tab", "space": "spc", "spc": "spc",
	"escape": "esc", "esc": "esc", "backspace": "backspace", "delete": "delete", "del": "delete", "insert": "insert",
	"home": "home", "end": "end", "pageup": "pgup", "page_up": "pgup", "pgup": "pgup", "pagedown": "pgdn", "page_down": "pgdn", "pgdn": "pgdn",
	"up": "up", "down": "down", "left": "left", "right": "right",
	"ctrl": "ctrl", "control": "ctrl", "control_l": "ctrl", "ctrl_r": "ctrl_r", "control_r": "ctrl_r",
	"alt": "alt", "alt_l": "alt", "alt_r": "alt_r", "altgr": "alt_r",
	"shift": "shift", "shift_l": "shift", "shift_r": "shift_r",
	"super": "meta_l", "super_l": "meta_l", "meta": "meta_l", "win": "meta_l", "cmd": "meta_l",
	"menu": "menu", "print": "print", "sysrq": "sysrq", "capslock": "caps_lock", "caps_lock": "caps_lock",
	"minus": "minus", "equal": "equal", "comma": "comma", "period": "dot", "dot": "dot", "slash": "slash",
	"backslash": "backslash", "semicolon": "semicolon", "apostrophe": "apostrophe", "grave": "grave_accent",
	"bracketleft": "bracket_left", "bracketright": "bracket_right",
}

// modifiers are qcodes held under another key.
var modifiers = []string{"ctrl", "ctrl_r", "alt", "alt_r", "shift", "shift_r", "meta_l"}

// Combo is the key press spec names: keys by name joined by "+" (
// "Return", "ctrl+alt+t", "F5", "a"), its modifiers first.
func Combo(spec string) (Key, error) {
	if spec == "" || len(spec) > 64 {
		return nil, fmt.Errorf("key %q: give a key by name (Return, ctrl+alt+t, F5, a): %w", spec, errdefs.ErrInvalidArgument)
	}
	var mods, keys Key
	for _, part := range strings.Split(spec, "+") {
		q, err := qcode(part)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", spec, err)
		}
		if slices.Contains(mods, q) || slices.Contains(keys, q) {
			return nil, fmt.Errorf("key %q names %s twice: %w", spec, part, errdefs.ErrInvalidArgument)
		}
		if slices.Contains(modifiers, q) {
			mods = append(mods, q)
		} else {
			keys = append(keys, q)
		}
	}
	if len(keys) > 1 {
		return nil, fmt.Errorf("key %q presses %d keys but modifiers at once: press them one at a time: %w", spec, len(keys), errdefs.ErrInvalidArgument)
	}
	return append(mods, keys...), nil
}

// qcode is the qcode of one key's name.
func qcode(name string) (string, error) {
	n := strings.ToLower(name)
	if q, ok := names[n]; ok {
		return q, nil
	}
	if len(n) == 1 && (n[0] >= 'a' && n[0] <= 'z' || n[0] >= '0' && n[0] <= '9') {
		return n, nil
	}
	if len(n) >= 2 && n[0] == 'f' {
		var f int
		if _, err := fmt.Sscanf(n, "f%d", &f); err == nil && f >= 1 && f <= 12 && fmt.Sprintf("f%d", f) == n {
			return n, nil
		}
	}
	return "", fmt.Errorf("no key %q: give a letter or digit, F1-F12, or a name such as Return, Tab, Escape, BackSpace, Up, ctrl, alt, shift, super: %w", name, errdefs.ErrInvalidArgument)
}

// Event is one of QMP input-send-event's events.
type Event struct {
	Type string         `json:"type"`
	Data map[string]any `json:"data"`
}

// MaxAxis is a tablet's largest coordinate: (x, y) of the screen maps to
// (x, y)*MaxAxis/(its size - 1).
const MaxAxis = 0x7fff

// Move is the pointer's move to (x, y) of a screen w by h.
func Move(x, y, w, h int) ([]Event, error) {
	if w <= 0 || h <= 0 {
		return nil, fmt.Errorf("the screen's size is not known: take a screenshot first: %w", errdefs.ErrFailedPrecondition)
	}
	if x < 0 || y < 0 || x >= w || y >= h {
		return nil, fmt.Errorf("point (%d, %d) is off the %dx%d screen: give 0 <= x < %d, 0 <= y < %d: %w", x, y, w, h, w, h, errdefs.ErrInvalidArgument)
	}
	scale := func(v, n int) int {
		if n == 1 {
			return 0
		}
		return v * MaxAxis / (n - 1)
	}
	return []Event{
		{Type: "abs", Data: map[string]any{"axis": "x", "value": scale(x, w)}},
		{Type: "abs", Data: map[string]any{"axis": "y", "value": scale(y, h)}},
	}, nil
}

// Button is a press (down) or release of a mouse button: left, middle,
// right, wheel-up or wheel-down.
func Button(name string, down bool) (Event, error) {
	switch name {
	case "left", "middle", "right", "wheel-up", "wheel-down":
		return Event{Type: "btn", Data: map[string]any{"button": name, "down": down}}, nil
	}
	return Event{}, fmt.Errorf("no mouse button %q: give left, middle or right: %w", name, errdefs.ErrInvalidArgument)
}
