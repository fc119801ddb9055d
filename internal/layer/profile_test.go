package layer_test

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/erofs"
)

func TestProfileFormat(t *testing.T) {
	hot := []erofs.Hot{
		{Path: "/usr/bin/python3.11"},
		{Path: "/usr/lib/gcc/cc1", Blocks: []erofs.BlockRange{{Start: 7, Count: 3}, {Start: 0, Count: 1}}},
		{Path: "/odd\tname"},
	}
	b := layer.FormatProfile(hot)
	if want := "/usr/bin/python3.11\n/usr/lib/gcc/cc1\t7+3,0+1\n"; string(b) != want {
		t.Fatalf("formatted %q, want %q", b, want)
	}
	got, err := layer.ParseProfile(bytes.NewReader(append([]byte("# recorded\n\n"), b...)))
	if err != nil || !reflect.DeepEqual(got, hot[:2]) {
		t.Fatalf("parsed %+v, %v", got, err)
	}
	for _, bad := range []string{"/a\t1", "/a\t1+0", "/a\tx+1", "/a\t1+2,", "/../etc\n", "/a\t4294967295+2"} {
		if _, err := layer.ParseProfile(strings.NewReader(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// FuzzProfile: any input parses or fails cleanly, and what parses
// formats back to the same profile.
func FuzzProfile(f *testing.F) {
	f.Add([]byte("/usr/bin/python3.11\n/usr/lib/gcc/cc1\t7+3,0+1\n"))
	f.Add([]byte("# c\n\n/a\t0+1\r\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		hot, err := layer.ParseProfile(bytes.NewReader(data))
		if err != nil {
			return
		}
		again, err := layer.ParseProfile(bytes.NewReader(layer.FormatProfile(hot)))
		if err != nil {
			t.Fatalf("formatted profile does not parse: %v", err)
		}
		if len(hot) != len(again) || (len(hot) > 0 && !reflect.DeepEqual(hot, again)) {
			t.Fatalf("round trip: %+v != %+v", hot, again)
		}
	})
}
