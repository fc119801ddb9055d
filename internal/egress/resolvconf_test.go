package egress

import (
	"net/netip"
	"testing"
)

// TestResolvConf: a resolv.conf naming a server off loopback is kept;
// one with none, or only loopback or closed ones, is replaced by one
// naming Nameserver, its search, domain and options kept.
func TestResolvConf(t *testing.T) {
	closed := func(a netip.Addr) bool { return netip.MustParsePrefix("10.0.0.0/8").Contains(a) }
	const written = "# written by dsec: the sandbox's DNS goes to its own resolver, whatever server it names\nnameserver 192.0.2.53\n"
	for _, c := range []struct{ in, want string }{
		{"nameserver 8.8.8.8\n", ""},
		{"nameserver 127.0.0.53\nnameserver 192.0.2.1\n", ""},
		{"nameserver 2001:db8::1\n", ""},
		{"", written},
		{"# nothing\n", written},
		{"nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch corp.test\n", written + "options edns0 trust-ad\nsearch corp.test\n"},
		{"nameserver ::1\nnameserver 0.0.0.0\nnameserver ::ffff:127.0.0.1\ndomain x.test\n", written + "domain x.test\n"},
		{"nameserver not-an-address\n", written},
		{"nameserver 10.200.3.1\nnameserver 10.0.0.2\n", written}, // closed: another sandbox's gateway, a private range
	} {
		out, changed := ResolvConf([]byte(c.in), closed)
		if c.want == "" {
			if changed || string(out) != c.in {
				t.Errorf("%q: changed to %q", c.in, out)
			}
		} else if !changed || string(out) != c.want {
			t.Errorf("%q: %q (changed %v), want %q", c.in, out, changed, c.want)
		}
	}
}
