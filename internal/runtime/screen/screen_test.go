package screen

import (
	"reflect"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
)

func TestText(t *testing.T) {
	got, err := Text("Hi, ~/a_b!\n")
	want := []Key{{"shift", "h"}, {"i"}, {"comma"}, {"spc"}, {"shift", "grave_accent"}, {"slash"}, {"a"}, {"shift", "minus"}, {"b"}, {"shift", "1"}, {"ret"}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("Text: %v %v, want %v", got, err, want)
	}
	for _, bad := range []string{"naïve", "\x00", "\xff", strings.Repeat("a", MaxText+1)} {
		if _, err := Text(bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("Text(%q): %v, want invalid argument", bad, err)
		}
	}
}

func TestCombo(t *testing.T) {
	for spec, want := range map[string]Key{
		"Return": {"ret"}, "enter": {"ret"}, "ctrl+alt+t": {"ctrl", "alt", "t"}, "t+ctrl": {"ctrl", "t"},
		"F5": {"f5"}, "f12": {"f12"}, "shift+Tab": {"shift", "tab"}, "super": {"meta_l"}, "BackSpace": {"backspace"}, "7": {"7"},
	} {
		if got, err := Combo(spec); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("Combo(%q): %v %v, want %v", spec, got, err, want)
		}
	}
	for spec, says := range map[string]string{
		"": "give a key by name", "hyper": `no key "hyper"`, "f13": `no key "f13"`, "f05": `no key "f05"`, "a+b": "one at a time",
		"ctrl+ctrl": "twice", "ctrl++": `no key ""`, strings.Repeat("a+", 40): "give a key by name",
	} {
		if _, err := Combo(spec); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), says) {
			t.Errorf("Combo(%q): %v, want invalid argument saying %q", spec, err, says)
		}
	}
}

func TestMove(t *testing.T) {
	ev, err := Move(1279, 0, 1280, 800)
	if err != nil || ev[0].Data["value"] != MaxAxis || ev[1].Data["value"] != 0 {
		t.Fatalf("the top right corner: %v %v", ev, err)
	}
	if ev, _ := Move(640, 400, 1280, 800); ev[0].Data["value"] != 640*MaxAxis/1279 {
		t.Errorf("the middle: %v", ev)
	}
	if _, err := Move(1280, 0, 1280, 800); !errdefs.IsInvalidArgument(err) {
		t.Errorf("off the screen: %v", err)
	}
	if _, err := Move(-1, 0, 1280, 800); !errdefs.IsInvalidArgument(err) {
		t.Errorf("off the screen: %v", err)
	}
	if _, err := Move(0, 0, 0, 0); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("no screen size: %v", err)
	}
	if _, err := Button("fourth", true); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a button: %v", err)
	}
}

// FuzzInput: whatever a tenant sends, the parsers answer keys QEMU
// knows (each a qcode of their tables, a letter, a digit or F1-F12) or
// an invalid-argument error, and never panic.
func FuzzInput(f *testing.F) {
	for _, s := range []string{"Return", "ctrl+alt+t", "Hello, world!\n", "f1", "a+b", "", "\xff"} {
		f.Add(s)
	}
	known := map[string]bool{}
	for _, q := range names {
		known[q] = true
	}
	for _, q := range plain {
		known[q] = true
	}
	for _, q := range shifted {
		known[q] = true
	}
	ok := func(q string) bool {
		return known[q] || len(q) == 1 && (q[0] >= 'a' && q[0] <= 'z' || q[0] >= '0' && q[0] <= '9') ||
			len(q) >= 2 && q[0] == 'f' && strings.Trim(q[1:], "0123456789") == ""
	}
	f.Fuzz(func(t *testing.T, s string) {
		keys, err := Text(s)
		if err != nil && !errdefs.IsInvalidArgument(err) {
			t.Fatalf("Text(%q): %v", s, err)
		}
		k, cerr := Combo(s)
		if cerr != nil && !errdefs.IsInvalidArgument(cerr) {
			t.Fatalf("Combo(%q): %v", s, cerr)
		}
		if cerr == nil {
			keys = append(keys, k)
		}
		for _, k := range keys {
			for _, q := range k {
				if !ok(q) {
					t.Fatalf("%q gave qcode %q", s, q)
				}
			}
		}
	})
}
