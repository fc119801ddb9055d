package remote

import (
	"net/netip"
	"testing"
)

// TestPublic: what a tenant's pull may connect to.
func TestPublic(t *testing.T) {
	for addr, want := range map[string]bool{
		"8.8.8.8": true, "151.101.1.1": true, "2606:4700::1111": true,
		"127.0.0.1": false, "::1": false, "10.0.0.1": false, "172.16.5.4": false, "192.168.1.1": false,
		"169.254.169.254": false, "fe80::1": false, "fd00::1": false, "100.100.100.200": false, "0.0.0.0": false,
		"0.1.2.3": false, "198.18.0.1": false, "192.0.0.170": false, "240.0.0.1": false, "255.255.255.255": false,
		"224.0.0.1": false, "64:ff9b::a9fe:a9fe": false, "2002:a9fe:a9fe::": false, "::ffff:127.0.0.1": false,
		"::ffff:10.1.1.1": false, "2001:db8::1": false,
	} {
		if got := Public(netip.MustParseAddr(addr)); got != want {
			t.Errorf("%s: public %v, want %v", addr, got, want)
		}
	}
}
