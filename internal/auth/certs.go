package auth

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
)

// Certificate files MakeCerts writes, in its directory.
const (
	CAFile         = "ca.pem"
	CAKeyFile      = "ca-key.pem"
	ServerFile     = "server.pem"
	ServerKeyFile  = "server-key.pem"
	ClientFile     = "client.pem"
	ClientKeyFile  = "client-key.pem"
	certsValidDays = 825 // what browsers and most TLS stacks still take
)

// MakeCerts writes into dir, for a user without a PKI, a CA and two
// certificates it signs: the worker's, for names (host names and IP
// addresses), and a client's (for --tls-client-ca). Keys are ECDSA
// P-256, mode 0600; nothing is overwritten. The CA may sign for names
// alone (critical name constraints: those host names and their
// subdomains, those addresses): a client that trusts it trusts it for
// the worker, never for another site, even should its key leak.
func MakeCerts(dir string, names []string) error {
	if len(names) == 0 {
		return fmt.Errorf("the worker's certificate needs at least one host name or address: %w", errdefs.ErrInvalidArgument)
	}
	files := []string{CAFile, CAKeyFile, ServerFile, ServerKeyFile, ClientFile, ClientKeyFile}
	for _, f := range files {
		if _, err := os.Lstat(filepath.Join(dir, f)); err == nil {
			return fmt.Errorf("%s exists: give another directory, or remove it first: %w", filepath.Join(dir, f), errdefs.ErrAlreadyExists)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	now := time.Now().Add(-time.Hour) // a host whose clock is a little behind
	until := now.Add(certsValidDays * 24 * time.Hour)
	caTmpl := &x509.Certificate{Subject: pkix.Name{CommonName: "dsec CA"}, NotBefore: now, NotAfter: until,
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		PermittedDNSDomainsCritical: true}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			bits := 8 * len(ip)
			if v4 := ip.To4(); v4 != nil {
				ip, bits = v4, 32
			}
			caTmpl.PermittedIPRanges = append(caTmpl.PermittedIPRanges, &net.IPNet{IP: ip, Mask: net.CIDRMask(bits, bits)})
		} else {
			caTmpl.PermittedDNSDomains = append(caTmpl.PermittedDNSDomains, n)
		}
	}
	// A kind of name with nothing permitted would be unbounded: none.
	if len(caTmpl.PermittedIPRanges) == 0 {
		caTmpl.ExcludedIPRanges = []*net.IPNet{{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}, {IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}}
	}
	if len(caTmpl.PermittedDNSDomains) == 0 {
		caTmpl.PermittedDNSDomains = []string{"invalid"} // RFC 2606: names nothing
	}
	caKey, caDER, err := issue(caTmpl, nil, nil)
	if err != nil {
		return err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	// Its common name is no host name: clients take the names from
	// its SANs, and some check a name-like one against the CA's
	// constraints too.
	server := &x509.Certificate{Subject: pkix.Name{CommonName: "dsec worker"}, NotBefore: now, NotAfter: until,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			server.IPAddresses = append(server.IPAddresses, ip)
		} else {
			server.DNSNames = append(server.DNSNames, n)
		}
	}
	serverKey, serverDER, err := issue(server, ca, caKey)
	if err != nil {
		return err
	}
	clientKey, clientDER, err := issue(&x509.Certificate{Subject: pkix.Name{CommonName: "dsec client"}, NotBefore: now, NotAfter: until,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}, ca, caKey)
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range []struct {
		name, kind string
		der        []byte
	}{{CAFile, "CERTIFICATE", caDER}, {CAKeyFile, "EC PRIVATE KEY", caKey}, {ServerFile, "CERTIFICATE", serverDER},
		{ServerKeyFile, "EC PRIVATE KEY", serverKey}, {ClientFile, "CERTIFICATE", clientDER}, {ClientKeyFile, "EC PRIVATE KEY", clientKey}} {
		mode := os.FileMode(0o644)
		if f.kind != "CERTIFICATE" {
			mode = 0o600
		}
		errs = append(errs, os.WriteFile(filepath.Join(dir, f.name), pem.EncodeToMemory(&pem.Block{Type: f.kind, Bytes: f.der}), mode))
	}
	return errors.Join(errs...)
}

// issue makes a key and a certificate of tmpl for it, signed by parent
// with parentKey (nil: self-signed); it returns the key's and the
// certificate's DER.
func issue(tmpl, parent *x509.Certificate, parentKey []byte) ([]byte, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, nil, err
	}
	tmpl.SerialNumber = serial
	signer := key
	if parent == nil {
		parent = tmpl
	} else if signer, err = x509.ParseECPrivateKey(parentKey); err != nil {
		return nil, nil, err
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, signer)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	return keyDER, der, err
}

// ClientTLS is the TLS configuration of a client of a worker (or
// gateway): the server's certificate checked against the CA in the PEM
// file ca (none: the system's roots), and the client's own certificate
// and key, for a server that asks for one (none: no certificate).
func ClientTLS(ca, cert, key string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if ca != "" {
		b, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("TLS CA: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("TLS CA %s holds no PEM certificate: %w", ca, errdefs.ErrInvalidArgument)
		}
	}
	if cert != "" || key != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, fmt.Errorf("client certificate %s and key %s: %v: %w", cert, key, err, errdefs.ErrInvalidArgument)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}
